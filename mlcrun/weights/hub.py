"""Hugging Face Hub downloads: a MODEL that is not a local path but looks like a hub id.

`owner/name` is a checkpoint repo: only the files mlcrun reads are fetched (config, safetensors
and their index, tokenizer, chat template, generation config). `owner/name/file.gguf` is one
GGUF file of a repo. `huggingface_hub` does the work: its cache (a cached snapshot is used
without asking the Hub again only when offline), `HF_HUB_OFFLINE`, `HF_TOKEN`, `HF_ENDPOINT`,
and progress bars on stderr. Its errors become one line naming the repo.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MlcrunError

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def hub_reference(model: str) -> tuple[str, str | None] | None:
    """(repo, GGUF file name or None) when `model` reads as a hub id, else None."""
    if model.startswith((".", "/", "~")) or "\\" in model or not model.strip():
        return None
    parts = model.split("/")
    if len(parts) == 2 and all(parts):
        return model, None
    if len(parts) == 3 and all(parts) and parts[2].lower().endswith(".gguf"):
        return "/".join(parts[:2]), parts[2]
    return None


def fetch(model: str, revision: str | None = None) -> Path:
    """The local path of `model`: itself when it exists, else its files from the Hub (a
    snapshot folder, or the GGUF file), downloaded unless already cached."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    ref = hub_reference(model)
    if ref is None:
        raise MlcrunError(f"{model}: no such file or folder")
    repo, filename = ref
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()  # its warnings would break our one-line errors
    try:
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision))
        folder = huggingface_hub.snapshot_download(
            repo, revision=revision, allow_patterns=list(CHECKPOINT_FILES)
        )
    except errors.GatedRepoError:
        raise MlcrunError(
            f"{repo} is gated on the Hub: accept its license there and set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise MlcrunError(
            f"{repo}: no such model repository on the Hub (a private one needs HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise MlcrunError(f"{repo}: no revision {revision!r} on the Hub") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        # (before EntryNotFoundError: the local miss is a kind of it)
        raise MlcrunError(
            f"{model} is not in the local Hugging Face cache, and the Hub cannot be reached "
            "(HF_HUB_OFFLINE is set, or no connection)"
        ) from None
    except errors.EntryNotFoundError:
        raise MlcrunError(f"{repo}: no file {filename!r} in the repository") from None
    except (errors.HfHubHTTPError, OSError) as err:
        detail = " ".join(str(err).split())[:200]
        raise MlcrunError(f"{model}: download from the Hub failed ({detail})") from None
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MlcrunError(
            f"{repo}: the repository has no config.json "
            f"(a GGUF repo? name the file: {repo}/FILE.gguf)"
        )
    return folder
