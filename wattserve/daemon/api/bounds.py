"""What one generation request may ask of the server, checked before any work is queued.

One request may not hold more choices (prompts x n) than `server.max_choices_per_request`,
nor more prompt tokens with logprobs (echo + logprobs: the prompt tokens x choices, each
kept with its alternatives until the answer is built) than
`server.max_prompt_logprob_tokens`; under `server.scheduling_policy = "fcfs"` its
`priority` must be 0, so that no client can jump the queue or decide whose KV is evicted.
Each refusal is an InvalidRequestError naming the parameter and the config key. This module
must not tokenize, queue or format responses.
"""

from __future__ import annotations

from wattserve.daemon.config import ServerConfig
from wattserve.daemon.engine.request import InvalidRequestError


def check_choices(server: ServerConfig, prompts: int, n: int) -> None:
    """Refuse prompts x n above server.max_choices_per_request (before tokenizing)."""
    choices = prompts * n
    if choices > server.max_choices_per_request:
        raise InvalidRequestError(
            f"the request asks for {choices} choices ({prompts} prompt(s) x n {n}); the limit "
            f"is {server.max_choices_per_request} (server.max_choices_per_request)",
            param="n",
            code="too_many_choices",
        )


def check_prompt_logprobs(server: ServerConfig, prompt_lens: list[int], n: int) -> None:
    """Refuse more prompt-logprob tokens than server.max_prompt_logprob_tokens; call only
    when the request asks for the prompt's logprobs (completions, echo with logprobs)."""
    tokens = sum(prompt_lens) * n
    if tokens > server.max_prompt_logprob_tokens:
        raise InvalidRequestError(
            f"echo with logprobs asks for {tokens} prompt-token logprobs (prompt tokens x n); "
            f"the limit is {server.max_prompt_logprob_tokens} "
            "(server.max_prompt_logprob_tokens)",
            param="logprobs",
            code="too_many_prompt_logprobs",
        )


def check_priority(server: ServerConfig, priority: int) -> None:
    """Under fcfs only priority 0 is served: any other value would be silently ignored."""
    if server.scheduling_policy == "fcfs" and priority != 0:
        raise InvalidRequestError(
            f'priority {priority} needs server.scheduling_policy = "priority"; this server '
            'schedules first come, first served (server.scheduling_policy = "fcfs"), so '
            "priority must be 0",
            param="priority",
            code="priority_not_enabled",
        )
