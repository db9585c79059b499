"""Model and tokenizer locations: a local folder, or a Hugging Face Hub id ("org/name") fetched into the Hub cache.

Hub settings are read from the environment when a download is asked for, not when huggingface_hub was
imported, so HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME and HF_ENDPOINT set by a running program still count.
Every failure (offline and not cached, no network, no such repo, gated, bad revision) is one DeepInferError.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from deepinfer_core.errors import DeepInferError

__all__ = ["CHECKPOINT_FILES", "TOKENIZER_FILES", "HubError", "is_hub_id", "resolve_location"]

CHECKPOINT_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_TRUE = {"1", "on", "yes", "true"}


class HubError(DeepInferError):
    """A Hugging Face Hub id that could not be found locally or fetched."""


def is_hub_id(name: str) -> bool:
    """True for "org/name" spellings (what the Hub accepts as a model repo id)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and "--" not in name and not name.endswith((".", "-"))


def resolve_location(
    name: str | Path,
    *,
    what: str = "model",
    revision: str | None = None,
    download_dir: str | Path | None = None,
    files: tuple[str, ...] = CHECKPOINT_FILES,
    progress: bool = True,
) -> tuple[Path, bool]:
    """(local folder, whether it came from the Hub) for a folder path or a Hub id.

    what: "model" or "tokenizer", for messages. files: the Hub files to fetch (glob patterns).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path, False
    text = str(name)
    if path.exists():
        raise HubError(f"{what} path {text} is not a directory (expected a Hugging Face checkpoint folder)")
    if not is_hub_id(text):
        raise HubError(
            f"{what} path {text} is not a directory, and not a Hugging Face Hub id of the form org/name; "
            "pass an existing checkpoint folder or a Hub id such as deepseek-ai/DeepSeek-V3"
        )
    return _download(text, what, revision, download_dir, files, progress), True


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _cache_dir(download_dir: str | Path | None) -> str | None:
    """download_dir, else the Hub cache the environment names now, else huggingface_hub's default."""
    if download_dir is not None:
        return str(Path(download_dir).expanduser())
    if cache := os.environ.get("HF_HUB_CACHE"):
        return cache
    if home := os.environ.get("HF_HOME"):
        return str(Path(home).expanduser() / "hub")
    return None


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not enabled and not was_disabled:
        disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            enable_progress_bars()


def _download(
    repo_id: str,
    what: str,
    revision: str | None,
    download_dir: str | Path | None,
    files: tuple[str, ...],
    progress: bool,
) -> Path:
    from huggingface_hub import errors, snapshot_download

    offline = _offline()
    cache = _cache_dir(download_dir)
    where = cache or "the default Hugging Face cache (~/.cache/huggingface/hub)"
    at = f" at revision {revision}" if revision else ""
    fetch_hint = f"`hf download {repo_id}" + (f" --revision {revision}" if revision else "") + "`"
    try:
        with _progress_bars(progress):
            folder = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                allow_patterns=list(files),
                local_files_only=offline,
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
    except errors.GatedRepoError:
        raise HubError(
            f"{what} {repo_id} is gated on the Hugging Face Hub: ask for access at https://huggingface.co/{repo_id}, "
            "then log in (`hf auth login`) or set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{what} {repo_id} is neither a local folder nor a repository on the Hugging Face Hub (if it is "
            "private, log in with `hf auth login` or set HF_TOKEN); check the spelling"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{what} {repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except getattr(errors, "IncompleteSnapshotError", ()) as err:  # huggingface_hub >= 2.0
        raise HubError(
            f"the cached copy of {what} {repo_id}{at} in {where} is incomplete and the Hub cannot be reached "
            f"({err.__class__.__name__}); finish the download with network access: {fetch_hint}"
        ) from None
    except errors.LocalEntryNotFoundError as err:
        if offline:
            raise HubError(
                f"HF_HUB_OFFLINE is set and {what} {repo_id}{at} is not in {where}; download it first with "
                f"{fetch_hint} (or unset HF_HUB_OFFLINE), or pass a local checkpoint folder"
            ) from None
        cause = err.__cause__ or err
        raise HubError(
            f"could not download {what} {repo_id}{at} from the Hugging Face Hub "
            f"({os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'}): "
            f"{cause.__class__.__name__}: {str(cause).splitlines()[0]}; it is not in {where} either. Check the "
            "network (proxy, HF_ENDPOINT), or download it elsewhere and pass the folder"
        ) from None
    except errors.HfHubHTTPError as err:
        raise HubError(f"the Hugging Face Hub refused {what} {repo_id}{at}: {str(err).splitlines()[0]}") from None
    except errors.HFValidationError as err:
        raise HubError(f"{repo_id!r} is not a valid Hugging Face Hub id: {err}") from None
    except OSError as err:
        raise HubError(f"could not store {what} {repo_id} in {where}: {err}") from None
    return Path(folder)
