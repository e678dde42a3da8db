"""The judge loop: trajectories in, scored samples (or unscored reports) out.

Consumes TRAJECTORIES durably and scores each trajectory with the configured judge
(`flywheel/judge/build.py`), up to `judge.max_concurrency` at once: it keeps fetching while
judgements run. Each judgement has `judge.deadline_s`. The result is published, and only then
the trajectory acknowledged:

- a `Sample` on SAMPLES (with the judge's `details`), referring to the trajectory by its
  sequence in TRAJECTORIES instead of carrying its tokens again, or
- an `Unscored` on UNSCORED with the reason, when the judge cannot score it (`Unscorable`),
  ran past the deadline, or failed unexpectedly (`judge error`, logged with its traceback).
  Never a silent zero.

With `memory.enabled`, the loop reads what each person's newest corrections ask for and
publishes their instructions on MEMORY for the gateways to serve (flywheel/judge/instruction_memory.py).
With `judge.teacher.memory`, the loop keeps each person's newest hints for the teacher
(flywheel/judge/hint_memory.py). What it remembers of people it drops when they are forgotten or
their memory is cleared: before it judges anything it reads every forget and clear on the audit
log (and the people's instructions on MEMORY), then follows the log; of a conversation kept out
of the memory (`X-Flywheel-Memory: false`) it remembers nothing (flywheel/judge/people_memory.py).
With `judge.teacher.wishes`, the teacher is told what a correction asks for as an instruction
(flywheel/judge/wishes.py). With `judge.teacher.practice`, a sample's corrected turns are practised once it is published
(flywheel/judge/practice.py): more samples on SAMPLES, before the trajectory is acknowledged;
with `judge.teacher.practice_history`, the person's earlier requests with them, remembered as
the hints are and dropped with them when the person is forgotten.

Both records carry the trajectory's id, so a re-publish after a crash is dropped as a
duplicate. If publishing fails (the bus is away), the trajectory is negatively acknowledged and
judged again on redelivery: nothing is lost, and one judgement failing never stops the loop.
The consumer's ack wait is short (`bus.ack_wait_s`), so a judge that dies has its trajectories
redelivered to the next one promptly; the ones being judged are kept from redelivery meanwhile
(`flywheel/bus/keepalive.py`). Other loops never wait on this one: it only consumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from flywheel.bus import (
    SAMPLE_SUBJECT,
    TRAJECTORY_SUBJECT,
    UNSCORED_SUBJECT,
    Delivery,
    Sample,
    Trajectory,
    Unscored,
    addresses,
)
from flywheel.bus.addresses import read_address
from flywheel.bus.consumer_loop import ConsumerLoop
from flywheel.bus.records import Record
from flywheel.bus.scan import take_all
from flywheel.bus.streams import AUDIT, AUDIT_SUBJECT, MEMORY, memory_subject
from flywheel.config import FlywheelConfig
from flywheel.judge.base import Unscorable, Verdict
from flywheel.judge.build import build_judge
from flywheel.judge.hint_memory import HintMemory
from flywheel.judge.instruction_memory import InstructionMemory
from flywheel.judge.people_memory import PeopleMemory
from flywheel.judge.practice import Practice, corrected_turns
from flywheel.judge.teacher import Teacher, Teaching, hints_of
from flywheel.judge.wishes import Wish, wish_reader
from flywheel.runtime import cancel_and_wait, repeat
from flywheel.tenants.forgotten import MEMORY_FORGETTING, forget_of

log = logging.getLogger(__name__)

REDELIVERY_DELAY_S = 1.0
"""Pause before a trajectory whose result could not be published is delivered again."""


class JudgeLoop(ConsumerLoop):
    name = "judge"
    subjects = TRAJECTORY_SUBJECT

    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "judge"):
        super().__init__(config, bus_url, durable)
        self.judge = build_judge(config)
        self.scored = 0
        self.unscored: Counter[str] = Counter()
        """Unscored trajectories by reason category (`no reward`, `no valid vote`, `deadline`, ...)."""
        self.publish_failures = 0
        self.instructions_published = 0
        self._in_flight: dict[asyncio.Task, Delivery] = {}
        self.teacher: Teacher | None = None
        self.practice: Practice | None = None
        self.memory = HintMemory(config.judge.teacher.memory) if config.judge.teacher.memory else None
        self.instructions = InstructionMemory(config.memory.corrections) if config.memory.enabled else None
        self._remembering = asyncio.Lock()

    async def prepare(self) -> None:
        await self.judge.start()
        teacher = self.config.judge.teacher
        if (teacher.wishes != "words" or (teacher.practice and teacher.practice_reward == "checks")
                or self.instructions is not None):
            await asyncio.to_thread(wish_reader)  # trained now, off the event loop
        self.teacher = self._teacher()
        self.practice = self._practice()
        if self._memories():  # every forget so far, and the people's instructions, before anything is judged
            await take_all(self.bus, AUDIT.name, self._heard)
            if self.instructions is not None:
                await take_all(self.bus, MEMORY.name, self.instructions.restore)
            self._tasks.append(asyncio.create_task(repeat(self._follow_forgetting, "judge.forget"), name="judge.forget"))

    def _memories(self) -> list[PeopleMemory]:
        """What the judge remembers of people: the teacher's hints, the requests practice replays,
        the corrections their served instructions are read from."""
        return [m for m in (self.memory, self.practice and self.practice.requests, self.instructions) if m is not None]

    async def _follow_forgetting(self) -> None:
        async for entry in self.bus.follow(AUDIT_SUBJECT, from_first=True):  # again after a fault: none missed
            self._heard(entry)

    def _remembers(self, trajectory: Trajectory) -> bool:
        """Whether the served memory reads this trajectory's corrections (on, and its tenant's)."""
        tenant = self.config.tenants.get(trajectory.tenant)
        return self.instructions is not None and (tenant is None or tenant.memory)

    async def _remember(self, trajectory: Trajectory, sample: Sample) -> None:
        """Read the corrections `sample` judged and publish their person's instructions, one
        conversation at a time: read in the order published, a slower publish of an older record
        never lands after a newer one of the same person (each holds all their newest reads)."""
        async with self._remembering:
            if (read := self.instructions.read(trajectory, sample)) is not None:
                await self.bus.replace(memory_subject(read.tenant, read.user_id), read)
                self.instructions_published += 1

    def _heard(self, entry: Record) -> None:
        """A forgotten tenant's or user's hints, requests and corrections leave the judge's memory,
        from when the forget begins (or a clear of their memory, `memory.clear`): nothing of
        theirs is published after it, nor remembered from what they said before it."""
        if (heard := forget_of(entry, MEMORY_FORGETTING)) is not None:
            for memory in self._memories():
                memory.forget(*heard)

    def _teacher(self) -> Teacher | None:
        """The hint teacher (`judge.teacher`) on the judge's own server, or with adapters on the
        policy's server, whose base (a request with no adapter) is the frozen starting model
        (`FlywheelConfig.base_teaches`); None when it is off or there is no server (then samples
        carry no teacher log-probs, said once in the log)."""
        if not self.config.judge.teaches():
            return None
        address = addresses.SERVE if self.config.base_teaches else addresses.JUDGE
        try:
            url = read_address(self.config.run_dir, address)
        except FileNotFoundError:
            log.warning("judge.teacher is on but no server wrote %s: no hint distillation", address)
            return None
        return Teacher(self.config.judge.teacher, url, self._key())

    def _practice(self) -> Practice | None:
        """Practice (`judge.teacher.practice`) on the policy's server, with the teacher; None when
        it is off, there is no teacher, or no policy server wrote its address."""
        if not self.config.judge.teacher.practice or self.teacher is None:
            return None
        try:
            url = read_address(self.config.run_dir, addresses.SERVE)
        except FileNotFoundError:
            log.warning("judge.teacher.practice is on but no policy server wrote %s: no practice", addresses.SERVE)
            return None
        teacher = self.config.judge.teacher
        return Practice(teacher.practice, url, self.teacher, self._key(),
                        checks=teacher.practice_reward == "checks", history=teacher.practice_history,
                        bare=self.config.memory.template if teacher.practice_prompt == "bare" else None)

    def _key(self) -> str | None:
        """The key the judge's own calls carry: the admin key, else the first client key."""
        keys = self.config.serve.api_keys
        return self.config.serve.admin_key or (keys[0] if keys else None)

    def held(self) -> list[Delivery]:
        return list(self._in_flight.values())

    async def step(self) -> None:
        room = self.config.judge.max_concurrency - len(self._in_flight)
        if room <= 0:
            await asyncio.wait(list(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
            return
        for delivery in await self.consumer.fetch(batch=room, timeout_s=0.5):
            task = asyncio.create_task(self._handle(delivery), name=f"judge {delivery.record.id}")
            self._in_flight[task] = delivery
            task.add_done_callback(lambda done: self._in_flight.pop(done, None))

    async def _handle(self, delivery: Delivery) -> None:
        trajectory = delivery.record
        assert isinstance(trajectory, Trajectory)
        unscorable: Unscorable | None = None
        wishes: dict[int, Wish] = {}
        try:
            record: Sample | Unscored
            record, wishes = await self._score(trajectory, delivery.stream_seq)
        except Unscorable as error:
            unscorable = error
            record = Unscored(id=trajectory.id, trajectory=trajectory, judge=self.judge.name, reason=error.reason)
        try:
            await self.bus.publish(UNSCORED_SUBJECT if unscorable else SAMPLE_SUBJECT, record)
            if isinstance(record, Sample):
                for sample in await self._practise(trajectory, record, wishes):
                    await self.bus.publish(SAMPLE_SUBJECT, sample)
                if self._remembers(trajectory):
                    await self._remember(trajectory, record)
            await delivery.ack()
        except Exception:
            self.publish_failures += 1
            log.exception("could not publish the judgement of %s; it will be redelivered", trajectory.id)
            with contextlib.suppress(Exception):
                await delivery.nak(delay_s=REDELIVERY_DELAY_S)
            return
        if unscorable is None:
            self.scored += 1
        else:
            self.unscored[unscorable.category] += 1
            log.warning("trajectory %s unscored by the %s judge: %s", trajectory.id, self.judge.name, unscorable.reason)

    async def _score(self, trajectory: Trajectory, stream_seq: int) -> tuple[Sample, dict[int, Wish]]:
        """The sample for `trajectory` (referring to it by its sequence in the TRAJECTORIES
        stream) and the wishes its turns were taught; `Unscorable` for whatever keeps it
        from being scored."""
        deadline_s = self.config.judge.deadline_s
        try:
            async with asyncio.timeout(deadline_s) as deadline:
                verdict: Verdict = await self.judge.score(trajectory)
            verdict.check(trajectory)
        except Unscorable:
            raise
        except TimeoutError as error:
            if not deadline.expired():
                raise Unscorable("judge error", f"TimeoutError: {error}") from error
            raise Unscorable("deadline", f"not judged within {deadline_s:g}s") from None
        except Exception as error:
            log.exception("the %s judge failed on %s", self.judge.name, trajectory.id)
            raise Unscorable("judge error", f"{type(error).__name__}: {error}") from error
        teaching, wishes = await self._teach(trajectory, verdict)
        return Sample(
            id=trajectory.id, trajectory_seq=stream_seq, reward=verdict.reward, turn_rewards=verdict.turn_rewards,
            judge=self.judge.name, details=verdict.details, judge_model=self.judge.identity,
            tenant=trajectory.tenant, user_id=trajectory.user_id, consent=trajectory.consent,
            **teaching.sample_fields(),
        ), wishes

    async def _teach(self, trajectory: Trajectory, verdict: Verdict) -> tuple[Teaching, dict[int, Wish]]:
        """What the teacher said of the turns that got a hint (flywheel/judge/teacher.py), and the
        wish each was told (its corrections; with the memory, the person's earlier ones after its
        own); nothing when there is no teacher, no hint, or the teacher failed (the sample goes
        without), and for a trajectory that may not be trained (nothing would use it)."""
        if self.teacher is None or not trajectory.consent:
            return Teaching(), {}
        own = hints_of(trajectory, verdict.details)
        said = ({k: [hint] for k, hint in own.items()} if self.memory is None  # remembered: those of turns judged below zero
                else self.memory.teach(trajectory, own, {k for k, r in enumerate(verdict.turn_rewards) if r < 0}))
        wishes = {k: Wish(corrections, self.config.judge.teacher.wishes) for k, corrections in said.items()}
        if not wishes:
            return Teaching(), {}
        hints = {k: each.told for k, each in wishes.items()}
        try:
            return await self.teacher.teach(trajectory, hints), wishes
        except Exception:
            log.exception("the teacher failed on %s; the sample goes without it", trajectory.id)
            return Teaching(), wishes

    async def _practise(self, trajectory: Trajectory, sample: Sample, wishes: dict[int, Wish]) -> list[Sample]:
        """The practice samples of the trajectory's corrected turns (flywheel/judge/practice.py);
        none without practice, or when it failed (the sample itself is published already)."""
        if self.practice is None:
            return []
        try:
            return await self.practice.samples(trajectory, wishes, corrected_turns(sample, trajectory))
        except Exception:
            log.exception("practice failed on %s; its sample goes on without it", trajectory.id)
            return []

    async def finish(self) -> None:
        """Abandon judgements in flight (unacknowledged: `stop` hands them back for redelivery)."""
        await cancel_and_wait(list(self._in_flight))
        await self.judge.close()
        if self.teacher is not None:
            await self.teacher.close()
        if self.practice is not None:
            await self.practice.close()

    def stats(self) -> dict[str, Any]:
        return {
            "scored": self.scored,
            "unscored": sum(self.unscored.values()),
            "unscored_by_reason": dict(self.unscored),
            "in_flight": len(self._in_flight),
            "publish_failures": self.publish_failures,
            "instructions_published": self.instructions_published,
            "malformed": self.consumer.malformed,
            "judge": self.judge.stats(),
            "teacher": self.teacher.counts if self.teacher else None,
            "practice": self.practice.counts if self.practice else None,
        }
