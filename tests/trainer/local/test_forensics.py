"""Hang forensics, the ranks' side: with rank 0 hung (its process alive, out of any collective) and rank 1
waiting for it in one, the operator's request under the run's prefix is answered by both ranks with their
threads' stacks, where each training thread is, the last completed step and the last log lines."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch.multiprocessing as multiprocessing

from fsdp_trainer.contract import (
    ForensicsRequest,
    RankStacks,
    TrainerConfig,
    forensics_request_name,
    rank_stacks_name,
)
from tests.support.net import free_port
from tests.support.trainer_runs import as_rank_of_two, config, train


def hang_on_rank(rank: int, port: int, trainer_json: str, marker: str) -> None:
    as_rank_of_two(rank, port)
    os.environ["FSDP_TRAINER_FAULT"] = f"rank=0,step=3,marker={marker},action=hang"
    train(TrainerConfig.model_validate_json(trainer_json), "job-1")


def wait_for(what: str, paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.5)


def test_both_ranks_answer_with_where_they_are_and_only_the_hung_one_is_out_of_a_collective(
    tmp_path: Path,
) -> None:
    trainer = config(tmp_path, max_steps=10)
    run = tmp_path / "team-a" / "tiny"
    marker = tmp_path / "hung"
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(target=hang_on_rank, args=(r, port, trainer.model_dump_json(), str(marker)))
        for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        wait_for("rank 0 to hang at step 3", [marker], timeout=300)
        request = run / forensics_request_name(1)
        request.parent.mkdir(parents=True, exist_ok=True)
        asked = ForensicsRequest(attempt=1, reason="Hang", requested_at="2026-12-04T12:00:00Z")
        request.write_text(asked.model_dump_json(by_alias=True))
        answers = [run / rank_stacks_name(1, rank) for rank in (0, 1)]
        wait_for("both ranks' stacks (each rank looks every 5 s)", answers, timeout=60)
    finally:
        for process in ranks:
            process.kill()
            process.join(timeout=30)
    hung, waiting = (RankStacks.model_validate_json(path.read_text()) for path in answers)
    assert (hung.rank, hung.world_size, waiting.rank) == (0, 2, 1)
    assert not hung.in_collective and "in trigger" in hung.training_thread_top, hung.training_thread_top
    assert waiting.in_collective, waiting.training_thread_top
    assert hung.step == 2 and waiting.step == 2  # both completed step 2; rank 1 waits inside step 3
    assert "fault injection: hang at step 3" in hung.recent_log
    names = {thread.name for thread in hung.threads}
    assert {"MainThread", "forensics", "rank-log"} <= names, names
    main = next(thread for thread in hung.threads if thread.name == "MainThread")
    assert "time.sleep(3600)" in main.stack

    # torch's flight recorder: rank 1 entered one collective more than rank 0 (step 3's), in the same group.
    def entered(answer: RankStacks) -> dict[str, int]:
        latest: dict[str, int] = {}
        for record in answer.collectives:
            latest[record.process_group] = max(latest.get(record.process_group, 0), record.seq)
        return latest

    hung_entered, waiting_entered = entered(hung), entered(waiting)
    assert hung_entered and hung.collectives[-1].op.startswith("gloo:"), hung.collectives
    assert any(waiting_entered[group] > seq for group, seq in hung_entered.items()), (
        hung_entered,
        waiting_entered,
    )


def test_under_ray_only_rank_0_reads_storage_and_the_others_follow_its_flag(tmp_path: Path) -> None:
    """One storage read per interval for the attempt, not one per rank: rank 1 does not see a request that is
    only in storage; rank 0 finds it, raises the flag in Ray's GCS, and then rank 1 answers too."""
    import ray

    from fsdp_trainer import forensics
    from fsdp_trainer.storage import Location

    class CountingRelay(forensics.RayRelay):
        """Counts the watcher's looks at the flag."""

        def __init__(self, run: Location) -> None:
            super().__init__(run, 1)
            self.looks, self.looked = 0, threading.Condition()

        def flagged(self) -> bool:
            flagged = super().flagged()
            with self.looked:
                self.looks += 1
                self.looked.notify_all()
            return flagged

        def looked_again(self, times: int) -> bool:
            with self.looked:
                until = self.looks + times
                return self.looked.wait_for(lambda: self.looks >= until, 30)

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    run = Location.parse(str(tmp_path / "team-a" / "tiny"))
    watches: list[forensics.ForensicsWatch] = []
    try:

        def watch(rank: int, relay: forensics.RayRelay) -> forensics.ForensicsWatch:
            started = forensics.ForensicsWatch(
                run, 1, rank, 2, lambda: 7, lambda: "", poll_seconds=0.1, relay=relay
            )
            watches.append(started)
            return started

        rank_1 = CountingRelay(run)
        watch(1, rank_1)
        request = tmp_path / "team-a" / "tiny" / forensics_request_name(1)
        request.parent.mkdir(parents=True, exist_ok=True)
        asked = ForensicsRequest(attempt=1, reason="Hang", requested_at="2026-12-04T12:00:00Z")
        request.write_text(asked.model_dump_json(by_alias=True))
        answers = [tmp_path / "team-a" / "tiny" / rank_stacks_name(1, rank) for rank in (0, 1)]
        # Counted in rank 1's polls, not in seconds: three looks at the flag after the request was stored.
        looked = rank_1.looked_again(3)
        assert not answers[1].exists(), "rank 1 must not read the request from storage"
        assert looked, "rank 1 stopped looking at the flag"
        watch(0, forensics.RayRelay(run, 1))
        wait_for("both ranks' stacks once rank 0 has raised the flag", answers, timeout=30)
    finally:
        for started in watches:
            started.stop()
        ray.shutdown()


def capture_while_a_collective_is_in_flight(rank: int, port: int, output: str) -> None:
    """Rank 0 starts an all-reduce without waiting for it and is asked for its stacks while rank 1 has not
    joined yet: its training thread is outside torch.distributed, as an NCCL rank's is when it blocks in
    `.item()` while its GPU waits in the collective."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    import torch
    import torch.distributed as dist

    from fsdp_trainer import forensics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        joined = Path(output) / "rank-1-may-join"
        if rank == 0:
            work = dist.all_reduce(torch.ones(4), async_op=True)
            answer = forensics.capture(0, 2, 5, "", threading.get_ident())
            (Path(output) / "rank0.json").write_text(answer.model_dump_json(by_alias=True))
            joined.touch()
            work.wait()
            done = forensics.capture(0, 2, 5, "", threading.get_ident())
            (Path(output) / "rank0-after.json").write_text(done.model_dump_json(by_alias=True))
        else:
            wait_for("rank 0's stacks", [joined], timeout=60)
            dist.all_reduce(torch.ones(4))
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_collective_has_not_completed_is_in_it_wherever_its_thread_is(tmp_path: Path) -> None:
    multiprocessing.spawn(
        capture_while_a_collective_is_in_flight, args=(free_port(), str(tmp_path)), nprocs=2
    )
    during = RankStacks.model_validate_json((tmp_path / "rank0.json").read_text())
    after = RankStacks.model_validate_json((tmp_path / "rank0-after.json").read_text())
    assert "in capture" in during.training_thread_top or "forensics.py" in during.training_thread_top
    assert during.in_collective, during.collectives
    assert [(record.op, record.completed) for record in during.collectives][-1] == ("gloo:all_reduce", False)
    assert not after.in_collective and after.collectives[-1].completed
