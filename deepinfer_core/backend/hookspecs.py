"""The backend contract (entry-point group `deepinfer.backends`) and the general-plugin contract
(`deepinfer.plugins`), as pluggy hook specifications.

A backend is a module (or object) with `@hookimpl` functions and a module-level
`DEEPINFER_API_VERSION = API_VERSION`. Each backend gets its own PluginManager; hooks are called by
keyword, so an implementation may take a subset of the arguments and a hook can grow new keyword
arguments without breaking anyone. Core calls backend hooks only in two places: discovery
(`info`, `capabilities`, `probe`) and engine build (everything else, once). The per-token path
calls the objects those hooks returned, never pluggy.

Required hooks have no default; optional hooks say what core does when a backend leaves them out.
"""

from __future__ import annotations

import pluggy
import torch

from deepinfer_core.backend._steps import CostModel, GraphCapture, StepTimer
from deepinfer_core.backend.extensions import LogitsProcessor, ModelRegistry, Observer
from deepinfer_core.backend.ops import AttentionOps, Ops
from deepinfer_core.backend.types import BackendInfo, Capabilities, DeviceFacts, ProbeResult
from deepinfer_core.kv.layout import KVLayout
from deepinfer_core.parallel.communicator import ExpertCommunicator
from deepinfer_core.sampling.sampler import Sampler

PROJECT = "deepinfer"
API_VERSION = 1  # bump only for breaking changes; adding optional hooks or keyword arguments is not one

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_BACKEND_HOOKS = (
    "deepinfer_backend_info",
    "deepinfer_backend_capabilities",
    "deepinfer_backend_probe",
    "deepinfer_backend_device",
    "deepinfer_backend_ops",
    "deepinfer_backend_kv_layout",
    "deepinfer_backend_attention",
)


class BackendSpec:
    """Hooks a backend implements. All are firstresult: the backend's answer wins over core's default."""

    # ---- discovery: called by the registry for `deepinfer backends` and for selection ------------

    @hookspec(firstresult=True)
    def deepinfer_backend_info(self) -> BackendInfo:
        """Identify the backend. Required.

        Returns: BackendInfo; its `name` must equal the entry-point name, `priority` orders `auto`
        selection (cpu is 0; vendor hardware should be above it), `aliases` are extra accepted names.
        Called: at discovery, once per process. Must not touch the device or import vendor runtimes.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_capabilities(self) -> Capabilities:
        """Declare what the backend can do, as frozen data. Required.

        Returns: Capabilities; anything unsupported is listed with a reason, which the conformance
        suite reports as a skip. Called: at discovery. Must be cheap and import-free like `info`.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_probe(self) -> ProbeResult:
        """Say whether the backend can run on this machine now, and if not, precisely why. Required.

        Returns: ProbeResult(available, reason, facts) — e.g. "torch_npu is not installed", "no GPU
        visible". Called: at discovery for every installed backend, so it must be cheap and must not
        fail: it may look for packages (importlib.util.find_spec) and device nodes, and may query an
        already-importable runtime, but must never raise.
        """

    # ---- engine build: called once, after selection ---------------------------------------------

    @hookspec(firstresult=True)
    def deepinfer_backend_device(self, index: int) -> DeviceFacts:
        """Describe device `index` of this backend (name, torch device string, total and free memory). An engine
        rank of a data-parallel world asks for the device of its rank number; a backend whose ranks share one
        device (the host) answers every index with it.

        Required. Called: at engine build, to place tensors and to size the KV cache.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_ops(self, device: DeviceFacts, dtype: torch.dtype, batch_invariant: bool) -> Ops:
        """Return the op table (norm, rotary, linear, activation, MoE routing, grouped expert FFN).

        Required. Args: the device from `deepinfer_backend_device`, the compute dtype (one of
        Capabilities.dtypes), and whether the engine runs in batch-invariant mode (asked only of
        backends whose Capabilities.batch_invariant is True: then every op's result for a row must
        not depend on the other rows). Called: once at engine build; model code then calls the table.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_kv_layout(self, device: DeviceFacts, block_size: int | None) -> KVLayout:
        """Return the physical KV-cache layout (block size, allocation, write, canonical gather).

        Required. Args: `block_size` is the operator's request, always one of Capabilities.block_sizes,
        or None for the backend's preferred size. Called: once at engine build, before the block
        manager is sized.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_attention(
        self, device: DeviceFacts, layout: KVLayout, dtype: torch.dtype, batch_invariant: bool
    ) -> AttentionOps:
        """Return attention over the paged cache stored in `layout`'s format.

        Required. `batch_invariant` as for `deepinfer_backend_ops` (a query's result must also not
        depend on how its prompt was chunked). Called: once at engine build, after the KV layout.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_sampler(self, device: DeviceFacts) -> Sampler:
        """Return sampler kernels with core's semantics (deepinfer_core.sampling.sampler).

        Optional; default: core's TorchSampler, plain tensor ops on the device.
        Called: once at engine build.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_communicator(self, device: DeviceFacts, world_size: int, rank: int) -> ExpertCommunicator:
        """Return the expert-parallel dispatch/combine transport for this rank (its `exchange` of whole rows also
        carries EPLB's expert weights between the ranks).

        Optional; default: AllToAllCommunicator over torch.distributed's default process group (which the
        launcher has initialised) when world_size is that group's size, else (world_size 1 with no such group, or
        a rank of data parallelism without expert parallelism) InProcessCommunicator.
        Called: once at engine build when the model has MoE layers.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_graph_capture(self, device: DeviceFacts) -> GraphCapture:
        """Return the device-graph capturer the engine replays decode steps with.

        Optional; default: none, every step runs eagerly. Consulted only when
        Capabilities.graph_capture is True. Called: once at engine build.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_cost_model(self, device: DeviceFacts, dtype: torch.dtype) -> CostModel:
        """Return the step cost model the scheduler sizes prefill chunks with.

        Optional; default: core's LinearCostModel with generic coefficients.
        Called: once at engine build.
        """

    @hookspec(firstresult=True)
    def deepinfer_backend_step_timer(self, device: DeviceFacts) -> StepTimer:
        """Return the timer the engine measures whole steps on the device with (adaptive speculative
        verification profiles verify steps at start-up and plans with the measured StepCostTable).

        Optional; default: core's WallClockStepTimer (host wall clock until the step's result is read back);
        a backend may time with device events instead. Called: once at engine build.
        """


class PluginSpec:
    """Hooks a general plugin implements; every plugin's answer is collected (not firstresult)."""

    @hookspec
    def deepinfer_logits_processors(self, model_name: str) -> list[LogitsProcessor]:
        """Return logits processors to apply to every request of `model_name` (may be empty).

        Called: once at engine build; the engine then calls the processors directly.
        """

    @hookspec
    def deepinfer_observers(self) -> list[Observer]:
        """Return observers of request events and engine steps (metrics, tracing, audit).

        Called: once at engine build; the engine then calls the observers directly.
        """

    @hookspec
    def deepinfer_register_models(self, registry: ModelRegistry) -> None:
        """Register model architectures (checkpoint `architectures` name -> factory) in `registry`.

        Called: once per process, when the model registry is first needed.
        """
