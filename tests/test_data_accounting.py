"""training/data_accounting.checked_rows on single micro batches (no trainer): the vocabulary check's one line and exit
status, placeholder ids kept out of the loss of text rows and counted, packed rows' skipped documents and token
counts."""

from types import SimpleNamespace

import pytest
import torch

from megatron_glm5.config import tiny_config
from megatron_glm5.training import data_accounting as acct


@pytest.fixture
def args(monkeypatch):
    a = SimpleNamespace(curr_iteration=4, log_interval=1, mock_data=False)
    monkeypatch.setattr(acct, "get_args", lambda: a)
    monkeypatch.setattr(acct, "DATA_COUNTS", {k: 0 for k in acct.DATA_COUNTS})
    monkeypatch.setattr(acct, "PACKING_EFFICIENCY", [None])
    return a


@pytest.fixture(scope="module")
def config():
    return tiny_config()  # vocabulary 256; image / video ids 250..255


def _rows(tokens):
    t = torch.tensor(tokens)
    return {"tokens": t, "labels": t.roll(-1, dims=1), "loss_mask": torch.ones(t.shape)}


def test_token_outside_the_vocabulary_ends_the_run_with_one_line(args, config, capsys):
    batch = _rows([[1, 2, 300, 4]])
    with pytest.raises(SystemExit) as e:
        acct.checked_rows(batch, config)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("pretrain_glm5_vlm.py: error: --data-path: a micro batch of iteration 5 holds token id "
                             "300, outside the model's vocabulary of 256"), err


def test_placeholder_ids_of_text_rows_are_kept_out_of_the_loss(args, config, capsys):
    batch = acct.checked_rows(_rows([[1, 250, 3, 4], [5, 6, 7, 8]]), config)
    # position 0's label and position 1's token are the image id 250
    assert batch["loss_mask"].tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert acct.DATA_COUNTS["placeholder_tokens_masked"] == 2
    assert "data: up to iteration 5 on this rank: 2 text token(s) that are image/video placeholder ids kept out of " \
           "the loss" in capsys.readouterr().out
    args.mock_data = True  # mock rows are not checked for placeholders
    assert acct.checked_rows(_rows([[250, 1]]), config)["loss_mask"].tolist() == [[1.0, 1.0]]


def test_packed_rows_count_skipped_documents_and_tokens(args, config, capsys):
    batch = _rows([[1, 250, 3, 4, 5, 6, 0, 0]])
    batch.update(cu_seqlens=torch.tensor([0, 6]), skipped_documents=torch.tensor([2]),
                 modality_tokens=torch.tensor([[4, 2, 0]]))
    out = acct.checked_rows(batch, config)
    assert "skipped_documents" not in out and "modality_tokens" not in out
    assert out["loss_mask"].tolist() == [[1.0] * 8]  # packed rows carry their own masks
    assert acct.DATA_COUNTS["documents_skipped"] == 2
    assert (acct.DATA_COUNTS["text_tokens"], acct.DATA_COUNTS["image_tokens"], acct.DATA_COUNTS["row_tokens"]) == \
        (4, 2, 8)
    assert acct.PACKING_EFFICIENCY[0] == 6 / 8
    assert "2 document(s) with an unreadable image or video skipped" in capsys.readouterr().out


def test_validation_micro_batches_are_not_counted_and_tags_are_written_per_step(args, config):
    """Token counts come from training micro batches only (Megatron-LM's evaluate runs under torch.no_grad);
    write_data_counts writes each data/* tag once at the step it is given."""
    def packed():
        batch = _rows([[1, 250, 3, 4, 5, 6, 0, 0]])
        batch.update(cu_seqlens=torch.tensor([0, 6]), skipped_documents=torch.tensor([1]),
                     modality_tokens=torch.tensor([[4, 2, 0]]))
        return batch

    acct.checked_rows(packed(), config)
    with torch.no_grad():
        acct.checked_rows(packed(), config)
    assert (acct.DATA_COUNTS["text_tokens"], acct.DATA_COUNTS["image_tokens"], acct.DATA_COUNTS["row_tokens"]) == \
        (4, 2, 8)
    assert (acct.DATA_COUNTS["documents_skipped"], acct.DATA_COUNTS["train_documents_skipped"]) == (2, 1)
    written = []
    acct.write_data_counts(SimpleNamespace(add_scalar=lambda *a: written.append(a)), 7)
    assert sorted(written) == [("data/documents-skipped", 1, 7), ("data/image-tokens", 2, 7),
                               ("data/text-tokens", 4, 7), ("data/video-tokens", 0, 7)]
