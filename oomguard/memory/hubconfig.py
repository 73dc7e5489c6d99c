"""A model named as users name it: a local directory, a ``config.json``, or a hub id (``ORG/NAME``) whose
``config.json`` is read from huggingface_hub's cache, fetched once where the hub can be reached. Only the config is
ever read: ``oomguard plan`` sizes a model from its shapes, never its weights.

>>> looks_like_hub_id("Qwen/Qwen2.5-1.5B-Instruct"), looks_like_hub_id("./model"), looks_like_hub_id("a/b/c")
(True, False, False)
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


class HubConfigError(ValueError):
    """One line: which model, why its config cannot be had, and the way out."""


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` can be a hub repository id (``NAME`` or ``ORG/NAME``), rather than a path."""
    return bool(_HUB_ID.match(name)) and not name.startswith(".") and ".." not in name


def config_path(name: str, *, revision: str | None = None) -> str:
    """The path of ``name``'s ``config.json``: ``name`` itself where it exists on disk, else the hub id's config from
    huggingface_hub's cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded first unless the hub is offline
    (``HF_HUB_OFFLINE=1``). Raises :class:`HubConfigError` with one line when there is none.

    >>> config_path(".")  # a path that exists is the user's own
    '.'
    """
    if os.path.exists(name) or not looks_like_hub_id(name):
        return name
    try:
        import huggingface_hub
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers requires it
        raise HubConfigError(f"{name}: not a local path, and huggingface_hub is not installed to read it as a hub id "
                             "(pip install huggingface_hub)") from None
    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if isinstance(cached, str):
        return cached
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if cached is not None:
        raise HubConfigError(f"{name}: the hub has no config.json for this repository (as {where} records); pass a "
                             "model directory or its config.json")
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise HubConfigError(f"{name}: not a local path, and no config.json for it in {where} while the hub is "
                             f"offline (HF_HUB_OFFLINE); fetch it once with `hf download {name} config.json`, or pass "
                             "a model directory or its config.json")
    try:
        return huggingface_hub.hf_hub_download(name, "config.json", revision=revision, etag_timeout=10)
    except Exception as e:  # every hub failure (network, gated, missing) is one line for the user
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubConfigError(f"{name}: not a local path, and its config.json is not in {where} and could not be "
                             f"fetched ({type(e).__name__}: {why[:160]}); pass a model directory or its config.json"
                             ) from None


__all__ = ["HubConfigError", "config_path", "looks_like_hub_id"]
