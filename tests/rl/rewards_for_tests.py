"""Reward functions the end-to-end tests select by import path."""


def digit_share(prompt: str, response: str, answer: str) -> float:
    """Share of digits in the response: varies across samples even for a random policy."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def raises(prompt: str, response: str, answer: str) -> float:
    raise ZeroDivisionError("this reward always fails")
