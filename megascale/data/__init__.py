"""megascale.data: deterministic, resumable, DP-sharded token loading.

Read in this order: ``tokenizer`` (bytes, EOD = 0) -> ``token_file`` (the ``PREFIX.bin`` /
``PREFIX.idx`` format) -> ``build`` (``megascale data build``) -> ``corpus`` (the built-in corpus)
-> ``dataset`` (samples, global order, ``ShardedBatches``).

``build`` is deliberately not re-exported here: ``megascale.data.build`` stays the module (the CLI
wires its ``add_arguments``/``run``); the function is ``megascale.data.build.build``.

Import the submodules directly (``from megascale.data.dataset import ShardedBatches``): this package
imports nothing itself, so ``megascale data build`` and the CLI's parser start without torch.
"""
