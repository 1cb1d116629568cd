"""megascale.data: deterministic, resumable, DP-sharded token loading.

Read in this order: ``tokenizer`` (bytes, EOD = 0) -> ``token_file`` (the ``PREFIX.bin`` /
``PREFIX.idx`` format) -> ``build`` (``megascale data build``) -> ``corpus`` (the built-in corpus)
-> ``dataset`` (samples, global order, ``ShardedBatches``).

``build`` is deliberately not re-exported here: ``megascale.data.build`` stays the module (the CLI
wires its ``add_arguments``/``run``); the function is ``megascale.data.build.build``.
"""

from megascale.data.corpus import default_token_file, generate_corpus
from megascale.data.dataset import GPTDataset, ShardedBatches, collate, epoch_order
from megascale.data.token_file import TokenFile, TokenFileError, write_token_file
from megascale.data.tokenizer import EOD, ByteTokenizer

__all__ = [
    "EOD",
    "ByteTokenizer",
    "GPTDataset",
    "ShardedBatches",
    "TokenFile",
    "TokenFileError",
    "collate",
    "default_token_file",
    "epoch_order",
    "generate_corpus",
    "write_token_file",
]
