"""LLaMA-Factory's own data path on a dataset directory, for bench_text.py's side-by-side figures.

Runs in LLaMA-Factory's virtualenv (``.venv-llamafactory``, made by ``bench_text.py
--llamafactory``), never in mmpack's: ``python llamafactory_get_dataset.py DATASET_DIR MODEL_DIR
OUT_DIR WORKERS``. It does what ``llamafactory-cli train`` does before training (argument parsing,
the tokenizer and processor, the template, ``get_dataset``: read, convert, tokenize; no packing)
and prints one JSON line: the samples and tokens of the train split, and the seconds since the
process started (imports included, as a user pays them).
"""

from __future__ import annotations

import json
import sys
import time

STARTED = time.time()

from llamafactory.data import get_dataset, get_template_and_fix_tokenizer  # noqa: E402
from llamafactory.hparams import get_train_args  # noqa: E402
from llamafactory.model import load_tokenizer  # noqa: E402


def main(dataset_dir: str, model_dir: str, out_dir: str, workers: str) -> None:
    model_args, data_args, training_args, _, _ = get_train_args(
        {
            "model_name_or_path": model_dir,
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "full",
            "dataset": "text_sharegpt",
            "dataset_dir": dataset_dir,
            "template": "qwen2_vl",
            "cutoff_len": 16384,
            "overwrite_cache": True,
            "preprocessing_num_workers": int(workers),
            "output_dir": out_dir,
            "report_to": "none",
        }
    )
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    train = module["train_dataset"]
    tokens = sum(len(ids) for ids in train["input_ids"])
    print(json.dumps({"samples": len(train), "tokens": tokens, "seconds": round(time.time() - STARTED, 2)}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
