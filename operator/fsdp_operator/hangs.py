"""Which rank hung, from every rank's answer to a forensics request, and what Ray Train's NCCL hang detector
found (pure)."""

from __future__ import annotations

from fsdp_operator import api
from fsdp_operator.bounds import bounded_text
from fsdp_trainer.contract import RankStacks


def suspect(answers: list[RankStacks], world_size: int | None) -> api.SuspectStatus | None:
    """A rank whose training thread is not in a collective while others wait in one: the others wait for it.
    Else a rank that entered fewer collectives of a process group than the others (torch's flight recorder:
    all wait, but not in the same collective); else the rank behind the others in steps; else a rank that did
    not answer (its process may be gone)."""
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
    out_of_step = _behind_in_collectives(answers)
    if out_of_step is not None:
        return out_of_step
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
    # Names and frames are the rank's to write: bounded and inert, as every tenant text in the status.
    return api.SuspectStatus(
        rank=answer.rank,
        pod=bounded_text(answer.pod, 253),
        node=bounded_text(answer.node, 253) if answer.node else None,
        why=bounded_text(why, 1000),
    )


def _ranks(answers: list[RankStacks]) -> str:
    ranks = sorted(a.rank for a in answers)
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _behind_in_collectives(answers: list[RankStacks]) -> api.SuspectStatus | None:
    """The rank that entered the fewest collectives of a process group the ranks disagree on."""
    entered: dict[str, dict[int, int]] = {}  # process group -> rank -> the last collective it entered
    for answer in answers:
        for record in answer.collectives:
            group = entered.setdefault(record.process_group, {})
            group[answer.rank] = max(group.get(answer.rank, 0), record.seq)
    for name, by_rank in sorted(entered.items()):
        if len(by_rank) < 2 or len(set(by_rank.values())) < 2:
            continue
        rank = min(by_rank, key=lambda r: (by_rank[r], r))
        ahead = [a for a in answers if by_rank.get(a.rank, 0) > by_rank[rank]]
        last = max(by_rank.values())
        answer = next(a for a in answers if a.rank == rank)
        return _named(
            answer,
            f"it entered collective {by_rank[rank]} of process group {name[:64] or '?'} and ranks "
            f"{_ranks(ahead)} collective {last}, where they wait for it (torch's flight recorder); its "
            f"training thread is at {answer.training_thread_top or 'an unknown frame'}",
        )
    return None


def nccl_hang_detector(answers: list[RankStacks]) -> api.NcclHangDetectorStatus | None:
    """Ray Train's NCCL hang detector as rank 0 reported it; None where rank 0 did not say (no answer, or a
    trainer from before the detector)."""
    report = next((a.nccl_hang_detector for a in answers if a.rank == 0 and a.nccl_hang_detector), None)
    if report is None:
        return None
    return api.NcclHangDetectorStatus(
        state=bounded_text(report.state, api.MAX_CONDITION_REASON),
        confirmed=report.confirmed,
        uri=bounded_text(report.uri, api.MAX_MESSAGE) if report.uri else None,
        finding=bounded_text(report.finding, api.MAX_MESSAGE),
    )
