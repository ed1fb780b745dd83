"""One choice of a request inside the engine: its tokens and how far the model has got.

Text, stop strings and timings live in output.py; KV sequences in kv_manager.py; when a
request runs in scheduler.py.
"""

from __future__ import annotations

from .sampler import SamplerState
from .spec.adaptive import Acceptance
from .types import SamplingParams, TokenConstraint

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Request:
    def __init__(
        self, request_id: str, prompt: list[int], params: SamplingParams, index: int = 0
    ) -> None:
        self.request_id = request_id
        self.index = index  # which of the `n` choices
        self.prompt = list(prompt)
        self.params = params
        self.tokens = list(prompt)  # prompt + output, appended in place
        self.sampler = SamplerState(params, self.prompt)
        self.status = WAITING
        self.seq_id: int | None = None  # its KV sequence while running
        self.num_computed = 0  # tokens whose K/V is in the cache
        self.num_draft_computed = 0  # ... in a draft model's cache (speculative decoding)
        # How often its drafts are accepted (adaptive K), per kind of draft: prompt lookup
        # keeps one per match length, whose drafts differ in how often they hold
        self.acceptances: dict[object, Acceptance] = {}
        self.draft_kind: object = None  # the kind of draft it would get this step
        self.order = 0  # admission order; the newest running request is preempted first
        self.fork_from: Request | None = None  # n > 1: siblings fork this request's prompt
        self.constraint: TokenConstraint | None = None  # masks the sampler when set
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it failed (finish_reason "error")
        self.cached_tokens = 0  # prompt tokens forked from the prefix cache
        self.preemptions = 0

    @property
    def acceptance(self) -> Acceptance:
        """The running acceptance of this step's kind of draft (`draft_kind`)."""
        acc = self.acceptances.get(self.draft_kind)
        if acc is None:
            acc = self.acceptances[self.draft_kind] = Acceptance()
        return acc

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def pending(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.sampler.append(token)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self.status = FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}#{self.index}, {self.status})"
