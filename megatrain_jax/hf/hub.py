"""``model.from_hf: ORG/NAME[@REVISION]``: a model on the Hugging Face Hub, through ``huggingface_hub``.

A value that is an existing path is a local directory, as before. Otherwise one of the form
``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, tag or commit) is a Hub id: its ``config.json``,
safetensors weights (and index) and tokenizer files are fetched with ``snapshot_download`` into
the Hugging Face cache, or found there, with that library's own settings (``HF_HUB_CACHE`` /
``HF_HOME``, ``HF_TOKEN`` or ``hf auth login``, ``HF_HUB_OFFLINE``), and the snapshot directory is
then read exactly as a local directory is. Every failure (offline and not cached, no such model or
revision, a gated model without a token, no network) is one ``UserError`` naming the id and the fix.
"""
from __future__ import annotations

import os
import re

from megatrain_jax.errors import UserError

# ORG/NAME as the Hub spells repository ids (letters, digits, - _ .), then @REVISION (which may hold a /)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(@(?P<rev>[^\s@]+))?$")
# what a model directory needs (the weights, their index and config) and the small files beside them
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "chat_template.jinja", "chat_template.json"]
_resolved: dict[tuple, str] = {}  # (id, cache, offline) -> snapshot directory, once per process


def parse_hub_id(spec: str | None) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` is a Hub id and not an existing path, else None."""
    if not spec or os.path.exists(spec) or spec.startswith((".", "~")) or spec.count("/") < 1:
        return None
    m = _HUB_ID.match(spec)
    if m is None or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("rev")


def hub_cache_dir() -> str:
    """The Hugging Face cache that ``snapshot_download`` uses (``HF_HUB_CACHE``, ``HF_HOME``/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def input_paths(spec: str | None) -> list[str]:
    """What a ``from_hf`` value reads, for the writers' rule (``atomic.check_place``) before
    anything is read: the local directory, or for a Hub id the whole Hugging Face cache."""
    if not spec:
        return []
    return [hub_cache_dir()] if parse_hub_id(spec) is not None else [spec]


def local_model_dir(spec: str, field: str = "model.from_hf", log=None) -> str:
    """A local directory holding the model ``spec`` names: ``spec`` itself unless it is a Hub id,
    else the snapshot in the Hugging Face cache (downloaded first where needed and allowed)."""
    parsed = parse_hub_id(spec)
    if parsed is None:
        return spec
    repo, rev = parsed
    cache, offline = hub_cache_dir(), _offline()
    key = (spec, cache, offline)
    path = _resolved.get(key)
    if path is None or not os.path.isdir(path):
        path = _resolved[key] = _download(spec, repo, rev, field, cache, offline)
    if log is not None:
        log(f"hf: {spec} is {path}")
    return path


def _download(spec: str, repo: str, rev: str | None, field: str, cache: str, offline: bool) -> str:
    """``snapshot_download`` of what a model directory needs; every failure as one ``UserError``."""
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError:  # a declared dependency; only a broken environment lacks it
        raise UserError(field, f"{spec} is a Hugging Face Hub id, and huggingface_hub is not installed",
                        "pip install huggingface_hub, or point it at a local model directory") from None
    local = "or point it at a local model directory (config.json + *.safetensors)"
    get = f"hf download {repo}" + (f" --revision {rev}" if rev else "")
    try:
        path = huggingface_hub.snapshot_download(repo, revision=rev, allow_patterns=ALLOW_PATTERNS)
    except hf_errors.GatedRepoError:
        raise UserError(field, f"{spec} is a gated model on the Hugging Face Hub and no token with access was "
                        "sent", f"accept its terms on huggingface.co/{repo}, then `hf auth login` or set HF_TOKEN; "
                        f"{local}") from None
    except hf_errors.RepositoryNotFoundError:
        raise UserError(field, f"{spec} is neither a local directory nor a model on the Hugging Face Hub (or it is "
                        "private and no token was sent)", f"check the id, `hf auth login` or set HF_TOKEN for a "
                        f"private model, {local}") from None
    except hf_errors.RevisionNotFoundError:
        raise UserError(field, f"{spec}: the Hugging Face Hub model {repo} has no revision {rev!r}",
                        f"give an existing branch, tag or commit after @, or leave @{rev} out") from None
    except hf_errors.LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":
            raise UserError(field, f"{spec}: its snapshot in the Hugging Face cache ({cache}) is incomplete and "
                            "cannot be completed now", f"download it again with network access (HF_HUB_OFFLINE "
                            f"unset), {local}") from None
        if offline:
            raise UserError(field, f"{spec} is not a local directory and is not in the Hugging Face cache "
                            f"({cache}), and HF_HUB_OFFLINE is set, so it cannot be downloaded",
                            f"unset HF_HUB_OFFLINE (or download it once with `{get}`), {local}") from None
        raise UserError(field, f"{spec} is not a local directory, is not in the Hugging Face cache ({cache}) and the "
                        "Hub could not be reached", f"check the network (or HF_ENDPOINT), download it where there is "
                        f"one with `{get}` and copy the cache, {local}") from None
    except hf_errors.HfHubHTTPError as e:
        raise UserError(field, f"{spec}: the Hugging Face Hub answered {_line(e)}",
                        f"try again later, {local}") from None
    except ValueError as e:  # HFValidationError: not a valid repo id after all
        raise UserError(field, f"{spec} is not a directory, nor a valid Hugging Face Hub id ({_line(e)})",
                        "give ORG/NAME[@REVISION] or a local model directory (config.json + *.safetensors)") from None
    except OSError as e:
        raise UserError(field, f"{spec}: downloading into the Hugging Face cache {cache} failed "
                        f"({e.__class__.__name__}: {_line(e)})", f"free space there or set HF_HUB_CACHE, {local}") from None
    return path


def _line(e: BaseException) -> str:
    """An exception's message as one short line (the CLI prints one line per error)."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
