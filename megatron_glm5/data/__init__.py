"""Training data: tokenizer, mock / indexed-text / packed image+text datasets, conversations rendered by the
checkpoint's chat template (``conversations.py``, ``chat_template.py``, videos in ``video_io.py``, Megatron-Energon
sources in ``energon.py``), sampler and collate.

``builder.build_train_valid_test_datasets`` is the entry point the training loop calls; ``sampler.build_data_loader``
turns a dataset into a resumable DataLoader. ``synthetic.py`` makes random packed rows for tests and the quickstart.
Untrusted input is checked where it is read: ``indexed.py`` (``.bin`` / ``.idx`` pairs), ``index_cache.py``
(megatron-core's index caches, installed by ``megatron_glm5.mcore_fixes``), ``jsonl.py`` (JSONL records) and
``vqa.py`` (images, tars), ``conversations.py`` / ``video_io.py`` (conversations, videos); each bad input is a
:class:`DataError` naming the file.
"""


from megatron_glm5.errors import DataError

__all__ = ["DataError"]
