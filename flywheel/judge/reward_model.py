"""The `model` judge: a learned reward model (a local HF checkpoint with a scalar head) scores
each assistant turn.

The checkpoint loads with `AutoModelForSequenceClassification` and must have one label (a
scalar per sequence). A turn's input is the conversation up to and including the turn's reply,
rendered with the reward model's own chat template when its tokenizer has one, else as plain
`role: text` paragraphs (`flywheel/judge/transcript.py`); longer than `max_length` tokens, it keeps its
end. The turn's reward is the model's raw scalar at the last token; the outcome follows from the
turn rewards (`outcome`: mean, last or min).

Turns are scored in batches of `batch_size` (padded on the right; no gradients) on one
dedicated worker thread, off the event loop. torch's intra-op thread count is process-wide:
`start()` sets it to `torch_threads` (default 1), because a second OpenMP team beside an engine
in the same process halves the engine's speed (docs/experiments/odd-things.md).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from flywheel.bus import Trajectory
from flywheel.config.judge import RewardModelJudgeConfig
from flywheel.judge import transcript
from flywheel.judge.base import Judge, Unscorable, Verdict, outcome_of


class RewardModelJudge(Judge):
    name = "model"

    def __init__(self, config: RewardModelJudgeConfig):
        if config.path is None:
            raise ValueError("judge.model.path: required for a model judge")
        self.config = config
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")

    async def start(self) -> None:
        import torch

        torch.set_num_threads(self.config.torch_threads)
        await self._run(self._load)

    async def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.path)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"judge.model.path: the tokenizer of {self.config.path} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(self.config.path).to(self.config.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"judge.model.path: {self.config.path} has {self.model.config.num_labels} labels, not 1 (a scalar head)")

    def render(self, trajectory: Trajectory, position: int) -> str:
        """The text the reward model reads for `trajectory.turns[position]`."""
        messages = transcript.conversation(trajectory.turns[position])
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return transcript.messages_text(messages)

    async def score(self, trajectory: Trajectory) -> Verdict:
        if not trajectory.turns:
            raise Unscorable("no turns", "the trajectory has no assistant turn to score")
        try:
            texts = [self.render(trajectory, i) for i in range(len(trajectory.turns))]
        except Exception as error:  # a chat template rejecting the conversation, say
            raise Unscorable("cannot render", f"{type(error).__name__}: {error}") from error
        turn_rewards = await self._run(self._forward, texts)
        return Verdict(outcome_of(turn_rewards, self.config.outcome), turn_rewards, {"model": self.config.path})

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.config.batch_size):
                batch = self.tokenizer(
                    texts[start:start + self.config.batch_size], padding=True,
                    add_special_tokens=not self.tokenizer.chat_template,  # a template adds its own
                    truncation=True, max_length=self.config.max_length, return_tensors="pt",
                )
                self._choose_pad_id(batch)
                logits = self.model(**batch.to(self.config.device)).logits
                scores += logits[:, 0].float().tolist()
        return scores

    def _choose_pad_id(self, batch) -> None:
        """Fill padding with an id that no row ends with, and tell the model: the scalar head
        reads each row at its last token not equal to the pad id (transformers' pooling)."""
        lengths = batch["attention_mask"].sum(dim=1)
        last_tokens = {int(row[n - 1]) for row, n in zip(batch["input_ids"], lengths)}
        candidates = [self.tokenizer.pad_token_id, *range(len(last_tokens) + 1)]
        pad_id = next(i for i in candidates if i not in last_tokens)
        batch["input_ids"][batch["attention_mask"] == 0] = pad_id
        self.model.config.pad_token_id = pad_id
