"""Rewards the `trl grpo` client names by import path (`rewards.unique_chars`)."""


def unique_chars(completions, **kwargs):
    return [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]
