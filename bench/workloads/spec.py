"""The parameters of every workload, in one typed record built from the command line."""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("random", "sharegpt", "bursty", "multiturn", "agentic", "reasoning", "custom")


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload to build and its shape. Lengths are in tokens."""

    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    dataset_path: str | None = None
    # random: input/output lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    # after a shared prefix of prefix_len tokens (vLLM's random dataset).
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    # sharegpt (synthetic when no dataset_path): fixes every output length if set.
    sharegpt_output_len: int | None = None
    # custom (a file of prompts): output length when a line gives none.
    custom_output_len: int = 256
    # bursty: steady short chats, and every `long_every`-th request a long prompt;
    # short_sharegpt draws the short ones' lengths as the synthetic ShareGPT does.
    short_sharegpt: bool = False
    short_input_len: int = 128
    short_output_len: int = 128
    long_input_len: int = 2048
    long_output_len: int = 16
    long_every: int = 8
    # multiturn: sessions of `turns` turns over one of `num_systems` shared system prompts.
    turns: int = 4
    system_len: int = 512
    num_systems: int = 4
    user_len: int = 64
    turn_output_len: int = 64
    think_time: float = 0.0
    system_share: float | None = None  # sessions on system prompt 0 (None: uniform)
    # agentic: the same sessions, each turn the model's output (turn_output_len) and a
    # tool's result of tool_len tokens on average (lognormal, sigma tool_len_sigma),
    # arriving tool_latency seconds on average (exponential) after the turn finished
    tool_len: int = 256
    tool_len_sigma: float = 0.5
    tool_latency: float = 1.0
    # reasoning: short prompts to a reasoning model, each with a thinking budget
    # (max_reasoning_tokens) and an answer after it; every `high_every`-th request is
    # high-effort (tag "high"), the rest low-effort ("low")
    reasoning_input_len: int = 256
    low_thinking: int = 64
    high_thinking: int = 2000
    answer_len: int = 64
    high_every: int = 5

    def validate(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown dataset {self.name!r}: choose from {', '.join(WORKLOADS)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        positive = {
            "--random-input-len": self.input_len,
            "--random-output-len": self.output_len,
            "--bursty-short-input-len": self.short_input_len,
            "--bursty-short-output-len": self.short_output_len,
            "--bursty-long-input-len": self.long_input_len,
            "--bursty-long-output-len": self.long_output_len,
            "--bursty-long-every": self.long_every,
            "--multiturn-turns": self.turns,
            "--multiturn-num-system-prompts": self.num_systems,
            "--multiturn-user-len": self.user_len,
            "--multiturn-output-len": self.turn_output_len,
            "--custom-output-len": self.custom_output_len,
            "--reasoning-input-len": self.reasoning_input_len,
            "--reasoning-answer-len": self.answer_len,
            "--reasoning-high-every": self.high_every,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.tool_len < 1 or self.tool_len_sigma < 0 or self.tool_latency < 0:
            raise ValueError("--agentic-tool-len must be >= 1, its sigma and "
                             "--agentic-tool-latency >= 0")  # fmt: skip
        if self.low_thinking < 0 or self.high_thinking < 0:
            raise ValueError("--reasoning-low-thinking and --reasoning-high-thinking must be >= 0")
        if self.prefix_len < 0 or self.system_len < 0 or self.think_time < 0:
            raise ValueError("prefix lengths and --multiturn-think-time must be >= 0")
        if self.system_share is not None and not 0.0 <= self.system_share <= 1.0:
            raise ValueError("--multiturn-system-prompt-share must be in [0, 1]")
        if self.name == "custom" and not self.dataset_path:
            raise ValueError("--dataset-name custom needs --dataset-path (a .jsonl or .txt file)")
