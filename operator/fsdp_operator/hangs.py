"""Which rank hung, from every rank's answer to a forensics request (pure)."""

from __future__ import annotations

from fsdp_operator import api
from fsdp_trainer.contract import RankStacks


def suspect(answers: list[RankStacks], world_size: int | None) -> api.SuspectStatus | None:
    """A rank whose training thread is not in a collective while others wait in one: the others wait for it.
    Else the rank behind the others in steps; else a rank that did not answer (its process may be gone)."""
    if not answers:
        return None
    waiting = [a for a in answers if a.in_collective]
    elsewhere = sorted((a for a in answers if not a.in_collective), key=lambda a: a.rank)
    if waiting and elsewhere:
        first = elsewhere[0]
        return _named(
            first,
            f"its training thread is at {first.training_thread_top or 'an unknown frame'} while ranks "
            f"{_ranks(waiting)} wait in a collective",
        )
    steps = {a.step for a in answers}
    if len(steps) > 1:
        behind = min(answers, key=lambda a: (a.step, a.rank))
        return _named(behind, f"it completed step {behind.step}, the others {max(steps)}")
    silent = sorted(set(range(world_size or 0)) - {a.rank for a in answers})
    if silent:
        return api.SuspectStatus(
            rank=silent[0], why=f"it did not answer (ranks {_ranks(answers)} did, all at step {steps.pop()})"
        )
    return None


def _named(answer: RankStacks, why: str) -> api.SuspectStatus:
    return api.SuspectStatus(
        rank=answer.rank, pod=answer.pod[:253], node=(answer.node or None), why=why[:1000]
    )


def _ranks(answers: list[RankStacks]) -> str:
    ranks = sorted(a.rank for a in answers)
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
