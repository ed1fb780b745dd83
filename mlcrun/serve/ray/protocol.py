"""What crosses between the Ray Serve ingress and the engine replicas (plain, picklable values).

No Ray import here: the ingress and the replicas both use these types, and tests build them
without a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...engine.engine import EngineStats
from ...engine.types import SamplingParams

# A token id as one character of the routing key (the astral planes hold every vocabulary:
# 0x10000 + 262,144 ids is far below 0x10FFFF, and no surrogate lies above 0x10000).
_KEY_BASE = 0x10000


def route_key(ids: Sequence[int]) -> str:
    """The prompt as the text Ray's PrefixCacheAffinityRouter matches, one character per token:
    a shared prefix of characters is a shared prefix of tokens, which is what a replica's
    prefix cache reuses (a text prefix is not: the same text can tokenize differently)."""
    return "".join(chr(_KEY_BASE + t) for t in ids)


@dataclass(frozen=True)
class EngineRequest:
    """One engine request (one prompt, `params.n` choices). `prompt` is the routing key: the
    router reads a `.prompt` attribute of the call's first argument."""

    prompt: str
    ids: list[int]
    params: SamplingParams
    request_id: str
    schema: dict | bool | None = None  # a JSON schema the answer must match (llguidance)
    schema_param: str = "response_format"  # the request field named in schema errors


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's state when it sent an output: its load and prefix-cache use. `seq` orders
    one replica's snapshots (streams from one replica may arrive out of order)."""

    replica: str
    pid: int
    seq: int
    in_flight: int  # engine requests this replica is serving
    requests: int  # engine requests it has received
    prompt_tokens: int
    cached_tokens: int  # prompt tokens its prefix cache supplied
    stats: EngineStats = field(default_factory=EngineStats)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
