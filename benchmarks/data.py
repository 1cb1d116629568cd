"""Data benchmarks, each side by side in one run (``--part build``, ``--part loader``; both by
default).

build: tokenize-and-write throughput: ``megascale data build`` vs megatron-core's builder fed one
document at a time by the same Hugging Face tokenizer (what Megatron-LM's ``preprocess_data.py``
does per worker), alternating rounds; tokens/s and the ratio. Input: the built-in corpus repeated
``--copies`` times (one document per paragraph); tokenizer: a byte-level BPE of ``--vocab`` ids
trained on it here (no download). Both write the same tokens (checked), so the difference is how
documents reach the tokenizer (batches vs one by one).

loader: per-step data wait and loader memory of ``data.loader = "node"`` (one loader per machine,
shared memory, next step prepared during the current one) vs ``"rank"`` (every rank reads its own
samples when the step starts), ``benchmarks/data_loader.py``.

    python benchmarks/data.py
    python benchmarks/data.py --part build --copies 8 --rounds 5 --vocab 4096
    python benchmarks/data.py --part loader --sample-ms 1 --step-ms 50
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import data_loader
import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer

from megascale.data.build import build, split_documents
from megascale.data.corpus import generate_corpus
from megascale.data.indexed import dtype_for_vocab
from megascale.data.tokenizer import train_bpe


def megatron_builder(text_path: Path, tok_path: Path, prefix: Path) -> int:
    """Documents encoded one at a time and added to megatron-core's IndexedDatasetBuilder."""
    tok = Tokenizer.from_file(str(tok_path))
    eod = tok.token_to_id("<|endoftext|>")
    dtype = dtype_for_vocab(tok.get_vocab_size()).type
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    tokens = 0
    for doc in split_documents(text_path.read_text()):
        ids = tok.encode(doc, add_special_tokens=False).ids + [eod]
        builder.add_document(np.array(ids, dtype=dtype), [len(ids)])
        tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "build", "loader"), default="all")
    parser.add_argument("--copies", type=int, default=4, help="corpus copies in the input")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    data_loader.add_arguments(parser)
    args = parser.parse_args()
    if args.part in ("all", "build"):
        build_throughput(args)
    if args.part in ("all", "loader"):
        data_loader.run(args)


def build_throughput(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        corpus = generate_corpus()
        tok_path = train_bpe(corpus.split("\n\n"), args.vocab, d / "tokenizer.json")
        text = d / "input.txt"
        text.write_text("\n\n".join([corpus.strip("\n")] * args.copies) + "\n")
        rates: dict[str, list[float]] = {"megascale data build": [], "megatron-core builder": []}
        for r in range(args.rounds):
            start = time.perf_counter()
            info = build([text], d / f"ours{r}", tok_path)
            rates["megascale data build"].append(info.tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            tokens = megatron_builder(text, tok_path, d / f"theirs{r}")
            rates["megatron-core builder"].append(tokens / (time.perf_counter() - start))
        ours, theirs = IndexedDataset(str(d / "ours0")), IndexedDataset(str(d / "theirs0"))
        assert len(ours) == len(theirs) and all(
            np.array_equal(ours[i], theirs[i]) for i in range(0, len(ours), 97)
        ), "the two builds wrote different tokens"
        print(f"input: {text.stat().st_size / 1e6:.1f} MB, {info.documents} documents, "
              f"{info.tokens} tokens, BPE vocab {args.vocab}, {args.rounds} rounds (median)")  # fmt: skip
        med = {name: statistics.median(v) for name, v in rates.items()}
        for name, rate in med.items():
            print(f"  {name:24s} {rate:12,.0f} tokens/s")
        ratio = med["megascale data build"] / med["megatron-core builder"]
        print(f"  ratio megascale / megatron-core: {ratio:.2f}x")


if __name__ == "__main__":
    main()
