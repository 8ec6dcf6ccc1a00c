"""What the installed transformers offers the peers that drive it: the API each relies on came in a known release,
so that a box with an older transformers (a GPU image's 5.17) runs every engine it can, and an engine that needs a
newer one says so when chosen instead of the whole install refusing (pyproject.toml's bound is the oldest that
serves the rest)."""

from __future__ import annotations

import re

import transformers

# transformers' generate() took the cache as `past_key_values` until 5.24, which renamed it `cache` (and deprecated
# the old name): the naive engine passes it under the name this release reads
CACHE_RENAMED = (5, 24)
# ContinuousBatchingConfig gained page_size in 5.18 and auto_switch_to_flash in 5.19: hf-cb sets both
CONTINUOUS_BATCHING_CONFIG = (5, 19)


def release(text: str = transformers.__version__) -> tuple[int, int]:
    """(major, minor) of a version string: "5.17.0" and "5.25.0.dev0" alike."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"transformers version {text!r} has no major.minor")
    return int(found.group(1)), int(found.group(2))


def generate_cache_argument(version: tuple[int, int] | None = None) -> str:
    return "cache" if (version or release()) >= CACHE_RENAMED else "past_key_values"


def continuous_batching_refusal(version: tuple[int, int] | None = None) -> str | None:
    """Why hf-cb cannot run on this transformers, or None."""
    have = version or release()
    if have >= CONTINUOUS_BATCHING_CONFIG:
        return None
    need = ".".join(map(str, CONTINUOUS_BATCHING_CONFIG))
    return (f"hf-cb needs transformers>={need} (ContinuousBatchingConfig's page_size and auto_switch_to_flash); "
            f"this environment has {transformers.__version__}: choose another engine or upgrade transformers")
