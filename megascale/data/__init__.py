"""megascale.data: Megatron-LM indexed datasets, tokenizers, blends; deterministic, resumable.

Read in this order: ``indexed`` (Megatron's ``PREFIX.bin``/``PREFIX.idx`` through megatron-core,
the checks, the ``PREFIX.json`` sidecar) -> ``tokenizer`` (byte; megatron-core's Hugging Face,
SentencePiece, tiktoken) -> ``build`` (``megascale data build``) -> ``convert`` (old MSTOKEN
files) -> ``corpus`` (the built-in corpus) -> ``blend`` (``data.blend``/``data.split`` parsing) -> ``dataset`` (megatron-core's blended GPT
datasets, ``ShardedBatches``, validation batches) -> ``node_loader`` (``data.loader``: one loader
per machine in shared memory).

``build`` is deliberately not re-exported here: ``megascale.data.build`` stays the module (the CLI
wires its ``add_arguments``/``run``); the function is ``megascale.data.build.build``.

Import the submodules directly (``from megascale.data.dataset import ShardedBatches``): this package
imports nothing itself, so the CLI's parser starts without torch; megatron-core is imported by the
functions that read or write datasets.
"""
