"""Text pieces of ``preload-gate status`` that need no record type: a key's
line, an attach failure's tail, where a rank's arena came from. Split from
:mod:`preload.daemon.status` (issue 39) so that module stays one concern.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pgbase.digest_text import short_digest
from preload.identity.key import WeightCacheKey


def origin_line(origin: str | None, generation: int, took_over_from: dict[str, Any] | None) -> str:
    """``origin   disk, generation 0`` / ``adopted ... generation 2, took over from pid P (daemon D)``."""
    text = f"origin   {origin or 'unknown (a daemon of an older release)'}, generation {generation}"
    if took_over_from:
        text += f", took over from pid {took_over_from.get('pid')} (daemon {took_over_from.get('daemon_id')})"
    return text


def _last_failure(last: dict[str, Any] | None) -> str:
    if not last:
        return ""
    ago = max(0.0, time.time() - float(last.get("at") or 0))
    who = " ".join(str(x) for x in (last.get("client") or "", f"pid {last['pid']}" if last.get("pid") else "") if x)
    return f"; last {ago:.0f} s ago{(' by ' + who) if who else ''}: {last.get('kind')}: {last.get('detail')}"


# The settings an operator compares with an engine's arguments (--dtype,
# --kv-cache-dtype, --quantization, --model-impl, the vLLM release): named on
# the key line whenever the key carries them, at their default too ("auto"),
# so a text status answers "does this daemon match my engine" without --json.
_KEY_ALWAYS = ("config_digest", "architecture", "dtype", "kv_cache_dtype", "quantization", "model_impl",
               "vllm_version")


def _key_text(key: dict[str, Any] | None) -> str:
    """The key's layout, then in the key's field order: every field of
    :data:`_KEY_ALWAYS` that is set (not None or empty), and every other field
    that is not at its default (content digest, stage and transport are on
    their own lines)."""
    if not key:
        return "(none)"
    shown = {"content_digest", "export_stage", "transport", "tp_size", "tp_rank", "pp_size", "pp_rank",
             "dp_size", "dp_rank"}
    parts = [f"tp {key.get('tp_rank')}/{key.get('tp_size')} pp {key.get('pp_rank')}/{key.get('pp_size')} "
             f"dp {key.get('dp_rank')}/{key.get('dp_size')}"]
    for f in dataclasses.fields(WeightCacheKey):
        # A field sent only when set is absent at its default (key.SENT_WHEN_SET): absent means the default.
        value = key.get(f.name, f.default)
        if f.name in shown or value in (None, "") or (value == f.default and f.name not in _KEY_ALWAYS):
            continue
        text = short_digest(value) if isinstance(value, str) and f.name.endswith("_digest") else value
        parts.append(f"{f.name}={text}")
    return " ".join(parts)
