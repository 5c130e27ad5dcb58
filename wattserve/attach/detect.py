"""Which server is attached: vLLM or SGLang, told by the prefix of its /metrics families.

It must not guess: an exposition with neither prefix (or both) is an error that names the URL.
"""

from __future__ import annotations

from wattserve.attach.names import SERVER_KINDS, ServerKind
from wattserve.attach.scrape import families


class DetectError(ValueError):
    """The server's kind could not be told; the message says why in one line."""


def detect_kind(text: str, url: str = "") -> ServerKind:
    """The kind whose families (`vllm:`, `sglang:`) the exposition carries."""
    names = families(text)
    found = [k for k in SERVER_KINDS if any(n.startswith(f"{k}:") for n in names)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DetectError(
            f"{url}/metrics has no vllm: or sglang: metrics (SGLang needs --enable-metrics); "
            "name the kind with --server-kind"
        )
    raise DetectError(f"{url}/metrics has both vllm: and sglang: metrics; name --server-kind")
