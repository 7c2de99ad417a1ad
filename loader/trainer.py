"""Train on mmpack shards with transformers' ``Trainer``: ``PackedTrainer``.

    from loader.trainer import PackedTrainer

    args = TrainingArguments("ckpt", per_device_train_batch_size=1, gradient_accumulation_steps=2)
    trainer = PackedTrainer(model=model, args=args, manifest="OUT/packed")
    trainer.train()                              # or train(resume_from_checkpoint=True)
    trainer.end_ranks()                          # last: every rank waits, the group ends

Run it under ``torchrun`` (or ``accelerate launch``) like any Trainer script. What it
changes in ``Trainer``, and why:

- **The dataloader.** Each rank reads its own plan (``PackedDataset``: equal steps on
  every rank, every bin once per epoch), through a ``StatefulDataLoader`` that accelerate
  neither dispatches from rank 0 nor re-shards. ``len`` is the rank's micro-batches per
  epoch (workers batch their own runs), and ``set_epoch`` reaches the dataset.
- **Batches** move to the device with ``PackedBatch.to`` (the metadata stays), and a
  micro-batch without images (videos) gets a masked idle image (video) so that every rank
  runs the vision tower as often on every step (FSDP, ZeRO-3; ``loader.training``);
  ``idle_media=False`` turns that off. Gemma 3's masks reach the model in the form its
  attention takes (``attention.with_model_masks``).
- **Attention.** ``attention="auto"`` sets the model's ``attn_implementation``:
  ``mmpack_varlen`` where an exact varlen kernel runs (CUDA sm80+, bf16/fp16: flash-attn-4,
  flash-attn, else torch's own FlashAttention-2), its Qwen-VL vision tower in one call a layer,
  else SDPA (``loader.attention.use_attention``); rank 0 prints ``varlen_report()``.
- **The loss** of a micro-batch is its summed cross-entropy (logits only at supervised
  positions) over the supervised tokens of the whole optimizer step, all micro-batches of
  all ranks, times the world size (DDP and FSDP average gradients over ranks): the same
  gradient as ``examples/train_qwen2_vl.py``.
- **Checkpoints** hold every rank's loader state (``mmpack-loader-rank{N}.pt``), and
  ``train(resume_from_checkpoint=…)`` continues the epoch exactly where it stopped without
  re-reading the batches Trainer skips (``accelerate.skip_first_batches`` would replay and
  decode them, then lose the loader's position). The weights come back even for models
  whose saved names differ from their own (Trainer drops those: transformers#43701).

- **Evaluation** (``eval_split=True`` with ``manifest``, or ``eval_dataset=PackedDataset(...,
  split="eval")``): every evaluation sample once across ranks, its loss summed per token and
  divided by the evaluation split's supervised tokens, overall (``eval_loss``) and per
  dataset (``eval_loss/<dataset>``), all-reduced; ``eval_strategy`` schedules it as usual.

``PackedDPOTrainer`` (``ref_model=``, ``beta=``) trains preference packs (DPO): each
micro-batch's pairs give their sigmoid DPO loss from one forward of the policy and one of
the frozen reference model (``loader.preference``), summed and divided by the pairs of the
whole optimizer step (all micro-batches, all ranks), times the world size. ``PackedTrainer``
refuses a preference pack (an SFT loss would train the rejected answers), and
``PackedDPOTrainer`` a pack without pairs.

``end_ranks()`` ends a distributed run without the hang that freeing DDP's reducer after its
gloo group can cause (see its docstring).

transformers, accelerate and torchdata are imported here only: ``import loader`` stays free
of them.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from loader.attention import VARLEN, use_attention, varlen_report
from loader.collate import PackedBatch, collate_packed
from loader.dataset import PackedDataset
from loader.hybrid import require_sample_isolation
from loader.preference import DPOOutput, dpo_losses, pair_logprobs, sequence_logprobs, step_pairs
from loader.training import (
    dataset_losses,
    idle_media_settings,
    step_supervised_tokens,
    summed_loss,
    token_losses,
    traced_samples,
    with_idle_media,
)

LOADER_STATE = "mmpack-loader-rank{rank}.pt"


class _Skipped:
    """What Trainer drops in place of the batches a resumed epoch had already trained."""


SKIPPED = _Skipped()


class EpochBatches:
    """The train dataloader Trainer sees: this rank's micro-batches of an epoch, counted, so
    that a checkpoint records where the epoch stands.

    Trainer resumes mid-epoch by ``accelerate.skip_first_batches(loader, n)``, which makes a
    new ``DataLoader`` over ``loader.dataset`` with ``loader``'s settings and drops its first
    ``n`` batches. Here that dataset (``_ResumedEpoch``) yields ``n`` placeholders and then
    the batches of this (restored) loader, and the settings below pass them through as they
    are, so nothing is read twice and the loader keeps its state."""

    batch_size = None  # what skip_first_batches copies: no batching, no workers, identity collate
    drop_last = False
    num_workers = 0
    prefetch_factor = None

    def __init__(self, loader: StatefulDataLoader, batches_per_epoch: int) -> None:
        self.loader, self.batches_per_epoch = loader, batches_per_epoch
        self.yielded, self.resumed_at = 0, 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[PackedBatch]:
        self.yielded, self.resumed_at = self.resumed_at, 0
        for batch in self.loader:
            self.yielded += 1
            yield batch

    @staticmethod
    def collate_fn(item: Any) -> Any:
        return item

    def set_epoch(self, epoch: int) -> None:
        self.loader.dataset.set_epoch(epoch)

    @property
    def dataset(self) -> _ResumedEpoch:
        return _ResumedEpoch(self)

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "batches": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch after its ``batches``; a state saved at an epoch's end
        leaves the loader as it is (Trainer starts the next epoch)."""
        if state["batches"] >= self.batches_per_epoch:
            return
        self.loader.load_state_dict(state["loader"])
        self.resumed_at = state["batches"]


class _ResumedEpoch(IterableDataset):
    """A resumed epoch as ``skip_first_batches`` reads it: placeholders for the batches
    already trained, then the rest from the restored loader."""

    def __init__(self, batches: EpochBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        yield from itertools.repeat(SKIPPED, self.batches.resumed_at)
        yield from self.batches

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)


def _rank_dataset(
    manifest: str, args: Any, options: dict[str, Any] | None, split: str = "train"
) -> PackedDataset:
    """This rank's reader of ``split``, seeded with the trainer's seed unless ``options`` say."""
    options = {"seed": args.seed, **(options or {})}
    return PackedDataset(
        manifest, rank=args.process_index, world_size=args.world_size, split=split, **options
    )


class PackedTrainerMixin:
    """The ``Trainer`` overrides (see the module docstring); ``PackedTrainer`` puts them on
    transformers' ``Trainer``. Pass ``manifest`` (and ``dataset_options`` for
    ``PackedDataset``) or a ready ``train_dataset``; ``trace`` appends one JSON line per
    micro-batch and rank to ``{trace}.rank{N}`` with what the training step received."""

    trains_pairs = False  # the loss this trainer computes: SFT (False) or preference pairs (True)

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any,
        *,
        manifest: str | None = None,
        train_dataset: PackedDataset | None = None,
        dataset_options: dict[str, Any] | None = None,
        idle_media: bool | None = None,
        attention: str | None = None,
        trace: str | None = None,
        eval_split: bool = False,
        eval_dataset: PackedDataset | None = None,
        **kwargs: Any,
    ) -> None:
        if args.dataloader_persistent_workers:
            raise ValueError(
                "dataloader_persistent_workers=True keeps the first epoch in the workers: PackedDataset "
                "needs new workers each epoch (set_epoch); leave it False"
            )
        if train_dataset is None:
            if manifest is None:
                raise ValueError("PackedTrainer needs manifest= (OUT/packed) or train_dataset=PackedDataset")
            train_dataset = _rank_dataset(manifest, args, dataset_options)
        if (train_dataset.rank, train_dataset.world_size) != (args.process_index, args.world_size):
            raise ValueError(
                f"the dataset reads as rank {train_dataset.rank} of {train_dataset.world_size}, the trainer "
                f"is rank {args.process_index} of {args.world_size}"
            )
        self._require_kind(train_dataset, "pack")
        if eval_split:
            if manifest is None:
                raise ValueError("eval_split=True reads the evaluation pack of manifest=: give it")
            eval_dataset = _rank_dataset(
                manifest, args, {**(dataset_options or {}), "shuffle": False}, "eval"
            )
        if eval_dataset is not None and not isinstance(eval_dataset, PackedDataset):
            raise ValueError(
                "PackedTrainer evaluates a PackedDataset (split='eval' or a manifest of its own), got "
                f"{type(eval_dataset).__name__}"
            )
        if eval_dataset is not None:
            self._require_kind(eval_dataset, "evaluation pack")
        require_sample_isolation(model)
        if attention is not None:  # "auto": mmpack_varlen where an exact varlen kernel runs, else SDPA
            chosen = use_attention(model, attention)
            if chosen == VARLEN and args.process_index == 0:
                print(varlen_report(), flush=True)
        settings = idle_media_settings(model.config)
        if idle_media and settings is None:
            raise ValueError(f"idle_media: mmpack has no idle media for {type(model).__name__}")
        super().__init__(
            model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs
        )
        self.idle_media = settings if idle_media is not False else None
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the whole step's tokens
        self.trace_path = f"{trace}.rank{args.process_index}" if trace else None
        self.epoch_batches: EpochBatches | None = None
        self._loader_state: dict[str, Any] | None = None

    def _require_kind(self, dataset: PackedDataset, what: str) -> None:
        """Refuse a preference pack under an SFT loss, and a pack without pairs under DPO."""
        if dataset.preference and not self.trains_pairs:
            raise ValueError(
                f"the {what} holds preference pairs: train it with PackedDPOTrainer (an SFT loss would "
                "train the rejected answers)"
            )
        if self.trains_pairs and not dataset.preference:
            raise ValueError(
                f'the {what} holds no preference pairs (its manifest has no "preference": true; '
                "datasets with ranking: true make pairs): train it with PackedTrainer"
            )

    # -- data ---------------------------------------------------------------------------------
    def get_train_dataloader(self) -> EpochBatches:
        dataset: PackedDataset = self.train_dataset
        size, workers = self.args.per_device_train_batch_size, self.args.dataloader_num_workers
        loader = StatefulDataLoader(
            dataset,
            batch_size=size,
            collate_fn=collate_packed,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
            prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
            multiprocessing_context=self.args.dataloader_multiprocessing_context if workers else None,
        )
        self.epoch_batches = EpochBatches(loader, dataset.num_batches(size, workers))
        if self._loader_state is not None:
            self.epoch_batches.load_state_dict(self._loader_state)
            self._loader_state = None
        return self.epoch_batches

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[PackedBatch], torch.Tensor | None]:
        """The optimizer step's micro-batches and what its loss is divided by (``step_normaliser``)."""
        batches = _step_batches(epoch_iterator, num_batches)
        return batches, self.step_normaliser(batches, device) if batches else None

    def step_normaliser(self, batches: list[PackedBatch], device: torch.device) -> torch.Tensor:
        """What an optimizer step's summed loss is divided by: its supervised tokens across ranks."""
        return step_supervised_tokens(batches, device)

    def summed_micro_batch_loss(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """A micro-batch's loss, summed (over its supervised tokens)."""
        return summed_loss(model, batch)

    def _prepare_inputs(self, inputs: PackedBatch) -> PackedBatch:
        batch = inputs.to(self.args.device)
        if self.idle_media is not None:
            batch = with_idle_media(batch, self.idle_media)
        return batch

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(
        self,
        eval_dataset: PackedDataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Every evaluation sample once across ranks (``evaluation_sums`` per batch, summed and
        all-reduced, then ``evaluation_metrics``); logged and handed to the callbacks like
        Trainer's own metrics."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError(f"no evaluation data: {type(self).__name__}(eval_split=True) or eval_dataset=")
        self._require_kind(dataset, "evaluation pack")
        loader = StatefulDataLoader(
            dataset,
            batch_size=self.args.per_device_eval_batch_size,
            collate_fn=collate_packed,
            num_workers=self.args.dataloader_num_workers,
        )
        was_training = self.model.training
        self.model.eval()
        totals = None
        with torch.no_grad():
            for batch in loader:
                sums = self.evaluation_sums(self._prepare_inputs(batch), dataset)
                totals = sums if totals is None else totals + sums
        if totals is None:
            totals = self.evaluation_sums(None, dataset)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        self.model.train(was_training)
        metrics = self.evaluation_metrics(totals, dataset, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def evaluation_sums(self, batch: PackedBatch | None, dataset: PackedDataset) -> torch.Tensor:
        """[2, datasets] float64: per dataset, one batch's summed token loss and supervised tokens
        (zeros for ``batch`` None)."""
        if batch is None:
            return torch.zeros(2, len(dataset.datasets), dtype=torch.float64, device=self.args.device)
        losses, positions = token_losses(self.model, batch)
        return dataset_losses(losses, positions, batch, dataset.datasets)

    def evaluation_metrics(
        self, totals: torch.Tensor, dataset: PackedDataset, prefix: str
    ) -> dict[str, float]:
        """``eval_loss`` per supervised token, ``eval_tokens`` and ``eval_loss/<dataset>``."""
        loss, tokens = totals.sum(dim=1).tolist()
        metrics = {f"{prefix}_loss": loss / max(tokens, 1), f"{prefix}_tokens": tokens}
        for name, (summed, count) in zip(dataset.datasets, totals.T.tolist(), strict=True):
            if count:
                metrics[f"{prefix}_loss/{name}"] = summed / count
        return metrics

    # -- the step -----------------------------------------------------------------------------
    def training_step(
        self, model: torch.nn.Module, inputs: PackedBatch, num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.trace_path:
            self._trace(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: PackedBatch,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if return_outputs:
            raise ValueError(f"{type(self).__name__} computes no outputs: its evaluate() sums the losses")
        loss = self.summed_micro_batch_loss(model, inputs)
        if num_items_in_batch is None:  # one micro-batch on its own
            num_items_in_batch = self.step_normaliser([inputs], loss.device)
        return loss * self.accelerator.num_processes / num_items_in_batch.to(loss.dtype)

    def _trace(self, batch: PackedBatch) -> None:
        record = {
            "epoch": self.train_dataset.epoch,
            "step": self.state.global_step,
            "rank": self.args.process_index,
            "samples": traced_samples(batch),
            "pairs": [
                [batch.meta["sample_ids"][c], batch.meta["sample_ids"][r]] for c, r in batch.meta["pairs"]
            ],
            "fillers": batch.meta["fillers"],
            "media": any(k in batch for k in ("pixel_values", "pixel_values_videos")),
        }
        with open(self.trace_path, "a") as out:
            out.write(json.dumps(record) + "\n")

    # -- checkpoints --------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(folder, exist_ok=True)
        torch.save(self.epoch_batches.state_dict(), os.path.join(folder, self._loader_file()))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """Trainer restores a checkpoint's weights with a plain ``load_state_dict``, which
        misses every weight ``save_pretrained`` renamed to the original checkpoint layout (all
        of the Qwen-VL line's: transformers#43701, open in 5.23): the model then resumes from
        its initial weights, with only a warning. When the saved names are not the model's,
        the checkpoint is read as ``from_pretrained`` reads it, then copied in, strictly."""
        model = model if model is not None else self.model
        saved = _saved_weight_names(resume_from_checkpoint)
        if (
            self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or saved is None
            or saved == set(model.state_dict())
        ):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        dtype = next(model.parameters()).dtype
        loaded = type(model).from_pretrained(resume_from_checkpoint, dtype=dtype, device_map="cpu")
        model.load_state_dict(loaded.state_dict(), strict=True)
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; a resume also restores this rank's loader from the checkpoint."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint to resume from in {self.args.output_dir}")
        if resume_from_checkpoint and not self.args.ignore_data_skip:
            path = os.path.join(resume_from_checkpoint, self._loader_file())
            if not os.path.exists(path):
                raise ValueError(
                    f"{resume_from_checkpoint} holds no loader state for rank {self.args.process_index} "
                    f"({self._loader_file()}): it was not saved by PackedTrainer with this world size"
                )
            self._loader_state = torch.load(path, weights_only=False)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _loader_file(self) -> str:
        return LOADER_STATE.format(rank=self.args.process_index)

    def end_ranks(self) -> None:
        """End a distributed run: wait for every rank, then destroy the process group. Call it
        last: a rank that exits with its group alive while another still works can abort in
        the group's destructor.

        DDP's wrapper goes first. Its reducer holds the group from C++, so a group destroyed
        while the reducer lives is only really freed when the reducer is (at exit, or when the
        trainer is), with the GIL held; the group's destructor then waits for gloo's threads,
        and one of them may need the GIL to free a finished collective's tensors: a hang (seen
        in CI, torch 2.13, py-spy: ``~ProcessGroupGloo`` joining a thread in
        ``~AsyncBarrierWork``). Freed while the group is still registered, the reducer only
        drops its reference, and the group's own destructor releases the GIL."""
        self.accelerator.wait_for_everyone()
        self.model_wrapped = self.model
        self.accelerator.free_memory()  # forgets the accelerator's DDP wrapper
        gc.collect()
        self.accelerator.end_training()


def _step_batches(epoch_iterator: Iterator[Any], num_batches: int) -> list[PackedBatch]:
    """The next ``num_batches`` micro-batches; a placeholder among them means the resume went wrong."""
    batches = list(itertools.islice(epoch_iterator, num_batches))
    if any(b is SKIPPED for b in batches):
        raise RuntimeError(
            "Trainer skipped fewer batches than the checkpoint's loader state had trained: "
            "resume with the gradient accumulation steps and batch size of the saved run"
        )
    return batches


def _saved_weight_names(checkpoint: str) -> set[str] | None:
    """The tensor names of a checkpoint's safetensors weights (one file or an index), or None."""
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as handle:
            return set(json.load(handle)["weight_map"])
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        with safe_open(single, "pt") as weights:
            return set(weights.keys())
    return None


class PackedTrainer(PackedTrainerMixin, Trainer):
    """transformers' ``Trainer`` on mmpack shards (see the module docstring)."""


class PackedDPOTrainerMixin(PackedTrainerMixin):
    """DPO on a preference pack (see the module docstring): ``ref_model`` (frozen here) and
    ``beta``; everything else as ``PackedTrainerMixin``. Logged with the loss: the step's
    ``rewards/accuracy`` (chosen reward above rejected), ``rewards/margin``,
    ``rewards/chosen`` and ``rewards/rejected``, means over this rank's pairs."""

    trains_pairs = True

    def __init__(
        self,
        model: torch.nn.Module,
        args: Any,
        *,
        ref_model: torch.nn.Module,
        beta: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, args, **kwargs)
        self.ref_model = ref_model.to(self.args.device).eval().requires_grad_(False)
        self.beta = beta
        self._rewards: list[torch.Tensor] = []  # [2, pairs] per micro-batch since the last log

    def step_normaliser(self, batches: list[PackedBatch], device: torch.device) -> torch.Tensor:
        """What an optimizer step's summed loss is divided by: its preference pairs across ranks."""
        return step_pairs(batches, device)

    def dpo(self, model: torch.nn.Module, batch: PackedBatch) -> DPOOutput:
        """The batch's pairs: their DPO losses and rewards (policy ``model``, this reference)."""
        policy = sequence_logprobs(model, batch)
        with torch.no_grad():
            reference = sequence_logprobs(self.ref_model, batch)
        return dpo_losses(*pair_logprobs(batch, policy), *pair_logprobs(batch, reference), beta=self.beta)

    def summed_micro_batch_loss(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """A micro-batch's DPO loss, summed over its pairs (their rewards are kept for the log)."""
        out = self.dpo(model, batch)
        self._rewards.append(torch.stack([out.chosen_rewards, out.rejected_rewards]).cpu())
        return out.losses.sum()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self._rewards:
            logs = {**logs, **_reward_metrics(torch.cat(self._rewards, dim=1), "rewards")}
            self._rewards = []
        super().log(logs, *args, **kwargs)

    def evaluation_sums(self, batch: PackedBatch | None, dataset: PackedDataset) -> torch.Tensor:
        """[4] float64: one batch's summed DPO loss, pairs, pairs whose chosen reward is the
        higher, and summed reward margin (zeros for ``batch`` None)."""
        if batch is None:
            return torch.zeros(4, dtype=torch.float64, device=self.args.device)
        out = self.dpo(self.model, batch)
        margin = (out.chosen_rewards - out.rejected_rewards).to(torch.float64)
        figures = [out.losses.sum(), torch.tensor(len(margin)), (margin > 0).sum(), margin.sum()]
        return torch.stack([f.to(device=self.args.device, dtype=torch.float64) for f in figures])

    def evaluation_metrics(
        self, totals: torch.Tensor, dataset: PackedDataset, prefix: str
    ) -> dict[str, float]:
        """The mean DPO loss over every evaluation pair, the rewards' accuracy and margin."""
        loss, pairs, right, margin = totals.tolist()
        per_pair = 1 / max(pairs, 1.0)
        return {
            f"{prefix}_loss": loss * per_pair,
            f"{prefix}_pairs": pairs,
            f"{prefix}_rewards/accuracy": right * per_pair,
            f"{prefix}_rewards/margin": margin * per_pair,
        }


def _reward_metrics(rewards: torch.Tensor, prefix: str) -> dict[str, float]:
    """Means of [2, pairs] (chosen, rejected) rewards: accuracy, margin and each side."""
    chosen, rejected = rewards.to(torch.float64)
    if not len(chosen):
        return {}
    return {
        f"{prefix}/accuracy": float((chosen > rejected).to(torch.float64).mean()),
        f"{prefix}/margin": float((chosen - rejected).mean()),
        f"{prefix}/chosen": float(chosen.mean()),
        f"{prefix}/rejected": float(rejected.mean()),
    }


class PackedDPOTrainer(PackedDPOTrainerMixin, Trainer):
    """transformers' ``Trainer`` running DPO on a preference pack (see the module docstring)."""
