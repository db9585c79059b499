"""Discovery: load installed backends and plugins from entry points, validate them, isolate failures.

Entry points are loaded with stevedore; every load or validation failure becomes a `BrokenPlugin`
(with its traceback) instead of an exception, so one bad distribution never hides the others. Each
backend gets its own pluggy PluginManager holding the contract, the backend and core's defaults.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import traceback
from dataclasses import dataclass
from typing import Any

import pluggy
from stevedore import ExtensionManager

from deepinfer_core.backend import _defaults
from deepinfer_core.backend.hookspecs import API_VERSION, PROJECT, REQUIRED_BACKEND_HOOKS, BackendSpec, PluginSpec
from deepinfer_core.backend.types import BackendInfo, Capabilities, ProbeResult

__all__ = ["BACKEND_GROUP", "PLUGIN_GROUP", "BackendEntry", "BrokenPlugin", "Discovery", "discover"]

BACKEND_GROUP = "deepinfer.backends"
PLUGIN_GROUP = "deepinfer.plugins"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an entry point came from."""

    group: str
    name: str
    target: str  # "module" or "module:attr"
    distribution: str
    version: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


@dataclass(frozen=True, slots=True)
class BrokenPlugin:
    origin: Origin
    error: str  # one readable paragraph
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class BackendEntry:
    origin: Origin
    info: BackendInfo
    capabilities: Capabilities
    probe: ProbeResult
    missing_hooks: tuple[str, ...]
    manager: pluggy.PluginManager

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def available(self) -> bool:
        return self.probe.available and not self.missing_hooks

    @property
    def reason(self) -> str:
        reasons = [self.probe.reason] if self.probe.reason else []
        if self.missing_hooks:
            short = (h.removeprefix("deepinfer_backend_") for h in self.missing_hooks)
            reasons.append("does not implement the required hooks " + ", ".join(short))
        return "; ".join(reasons)


@dataclass(frozen=True, slots=True)
class Discovery:
    backends: tuple[BackendEntry, ...]
    plugins: tuple[Origin, ...]
    plugin_manager: pluggy.PluginManager  # every loaded general plugin, under PluginSpec
    broken: tuple[BrokenPlugin, ...]


class _Refused(Exception):
    """A plugin failed validation; the message is for people."""


def _origins(group: str) -> dict[tuple[str, str], Origin]:
    origins = {}
    for ep in importlib.metadata.entry_points(group=group):
        dist = ep.dist
        name, version = (dist.metadata["Name"], dist.version) if dist else ("unknown distribution", "?")
        origins[(ep.name, ep.value)] = Origin(group, ep.name, ep.value, name, version)
    return origins


def _load(group: str) -> tuple[list[tuple[Origin, Any]], list[BrokenPlugin]]:
    """Import every entry point of `group`; failures are collected, not raised."""
    origins = _origins(group)
    broken: list[BrokenPlugin] = []

    def origin_of(ep) -> Origin:
        return origins.get((ep.name, ep.value)) or Origin(group, ep.name, ep.value, "unknown distribution", "?")

    def on_failure(_manager, ep, err: BaseException) -> None:
        tb = "".join(traceback.format_exception(err))
        broken.append(BrokenPlugin(origin_of(ep), f"import failed: {type(err).__name__}: {err}", tb))

    # stevedore memoises entry points per group for the process; discovery must see the current path
    ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    manager = ExtensionManager(group, invoke_on_load=False, on_load_failure_callback=on_failure)
    return [(origin_of(ext.entry_point), ext.plugin) for ext in manager.extensions], broken


def _check_api_version(origin: Origin, plugin: Any) -> None:
    declared = getattr(plugin, "DEEPINFER_API_VERSION", None)
    if declared is None:
        raise _Refused(
            f"{origin.label} does not declare DEEPINFER_API_VERSION; this DeepInfer speaks contract "
            f"version {API_VERSION}. Add `DEEPINFER_API_VERSION = {API_VERSION}` to {origin.target}."
        )
    if declared != API_VERSION:
        raise _Refused(
            f"{origin.label} was built for DeepInfer contract version {declared}, but this DeepInfer "
            f"speaks version {API_VERSION}. Install a {origin.distribution} release built for contract "
            f"version {API_VERSION}, or a DeepInfer that speaks version {declared}."
        )


def _check_signatures(origin: Origin, plugin: Any, manager: pluggy.PluginManager) -> None:
    """Every `deepinfer_*` attribute must be a hook of the contract taking a subset of its arguments."""
    for attr in dir(plugin):
        caller = getattr(manager.hook, attr, None) if attr.startswith(PROJECT + "_") else None
        has_spec = caller is not None and caller.spec is not None
        marked = manager.parse_hookimpl_opts(plugin, attr) is not None
        if not (has_spec or marked):
            continue  # an ordinary attribute
        if not has_spec:
            raise _Refused(f"{origin.label} implements {attr}, which is not a hook of contract version {API_VERSION}.")
        if not marked:
            raise _Refused(f"{origin.label}: {attr} is missing the @hookimpl marker (deepinfer_core.backend.hookimpl).")
        impl = getattr(plugin, attr)
        impl_args = [p for p in inspect.signature(impl).parameters if p != "self"]
        spec_args = caller.spec.argnames
        unknown = [a for a in impl_args if a not in spec_args]
        if unknown:
            raise _Refused(
                f"{origin.label}: hook {attr}({', '.join(impl_args)}) does not match the contract's "
                f"{attr}({', '.join(spec_args)}): unknown argument(s) {', '.join(unknown)}. A hook may "
                f"take any subset of the contract's arguments, by the same names."
            )


def _register(origin: Origin, plugin: Any, manager: pluggy.PluginManager) -> str:
    _check_api_version(origin, plugin)
    _check_signatures(origin, plugin, manager)
    try:
        return manager.register(plugin, name=origin.name)
    except (pluggy.PluginValidationError, ValueError) as err:
        raise _Refused(f"{origin.label} was refused by the plugin manager: {err}") from err


def _backend_entry(origin: Origin, plugin: Any) -> BackendEntry:
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(BackendSpec)
    _register(origin, plugin, manager)
    manager.register(_defaults, name="deepinfer-core-defaults")
    hook = manager.hook
    implemented = {
        h for h in REQUIRED_BACKEND_HOOKS if any(i.plugin is plugin for i in getattr(hook, h).get_hookimpls())
    }
    try:
        info = hook.deepinfer_backend_info()
        capabilities = hook.deepinfer_backend_capabilities()
    except Exception as err:
        raise _Refused(f"{origin.label}: info/capabilities hook raised {type(err).__name__}: {err}") from err
    if not isinstance(info, BackendInfo) or not isinstance(capabilities, Capabilities):
        raise _Refused(f"{origin.label}: the info/capabilities hooks must return BackendInfo and Capabilities.")
    if info.name != origin.name:
        raise _Refused(f"{origin.label}: BackendInfo.name {info.name!r} differs from the entry-point name.")
    try:
        probe = hook.deepinfer_backend_probe()
    except Exception as err:  # a probe must not raise; report it as the reason instead
        probe = ProbeResult.unavailable(f"probe raised {type(err).__name__}: {err}")
    if not isinstance(probe, ProbeResult):
        probe = ProbeResult.unavailable("deepinfer_backend_probe did not return a ProbeResult")
    missing = tuple(h for h in REQUIRED_BACKEND_HOOKS if h not in implemented)
    return BackendEntry(origin, info, capabilities, probe, missing, manager)


def _isolated(origin: Origin, broken: list[BrokenPlugin], build, *args):
    """Run build(*args); a refusal or any error becomes a BrokenPlugin and None."""
    try:
        return build(*args)
    except _Refused as err:
        broken.append(BrokenPlugin(origin, str(err)))
    except Exception as err:
        tb = "".join(traceback.format_exception(err))
        broken.append(BrokenPlugin(origin, f"{origin.label}: {type(err).__name__}: {err}", tb))
    return None


def discover() -> Discovery:
    """Load every installed backend and plugin. Never raises for a bad plugin."""
    loaded, broken = _load(BACKEND_GROUP)
    backends: dict[str, BackendEntry] = {}
    for origin, plugin in loaded:
        if origin.name in backends:
            first = backends[origin.name].origin
            taken = f"{origin.label}: backend name {origin.name!r} is already taken by {first.label}."
            broken.append(BrokenPlugin(origin, taken))
            continue
        entry = _isolated(origin, broken, _backend_entry, origin, plugin)
        if entry is not None:
            backends[origin.name] = entry

    plugin_loaded, plugin_broken = _load(PLUGIN_GROUP)
    broken += plugin_broken
    plugin_manager = pluggy.PluginManager(PROJECT)
    plugin_manager.add_hookspecs(PluginSpec)
    plugins = []
    for origin, plugin in plugin_loaded:
        if _isolated(origin, broken, _register, origin, plugin, plugin_manager) is not None:
            plugins.append(origin)
    ordered = sorted(backends.values(), key=lambda b: (-b.info.priority, b.name))
    return Discovery(tuple(ordered), tuple(plugins), plugin_manager, tuple(broken))
