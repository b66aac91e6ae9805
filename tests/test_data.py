"""Prompt files: every malformed line is refused at load time with the file and line named; the prompt
order's generator seed comes from the one seed mixer."""

import pytest
import torch

from fgrpo.data import load_prompts, step_prompt_indices
from fgrpo.rollout.seeds import PROMPT_ORDER, sample_seed


@pytest.mark.parametrize("quoted", ['""', '" "', '"\t"'])
def test_blank_quoted_target_is_refused_with_file_and_line(tmp_path, quoted):
    p = tmp_path / "p.txt"
    p.write_text(f'A sign that says "OPEN"\n\nA sign that says {quoted}\n')
    with pytest.raises(
        ValueError, match=f"data.train_prompts: line 3 of '{p}' has no double-quoted target.*whitespace"
    ):
        load_prompts(p, require_quoted=True)
    assert len(load_prompts(p)) == 2  # without the OCR contract the line is an ordinary prompt


def test_line_numbers_count_blank_lines(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text('"A"\n\n\nno quote\n')
    with pytest.raises(ValueError, match=f"line 4 of '{p}' has no double-quoted target"):
        load_prompts(p, require_quoted=True)


def test_non_utf8_file_is_one_line_error_with_offset(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes('"OPEN"\nA caf\xe9 sign "CAFE"\n'.encode("latin-1"))
    with pytest.raises(
        ValueError, match=rf"^data.train_prompts: '{p}' is not UTF-8 text \(byte 12, line 2:"
    ) as e:
        load_prompts(p)
    assert "\n" not in str(e.value)


def test_utf8_bom_is_not_part_of_the_first_prompt(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "\\"A\\""}\n')
    assert load_prompts(p, require_quoted=True) == ['"A"']


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "line 2 of '.*' is not JSON"),
        ('["a list"]', "line 2 of '.*' is not a JSON object with a 'prompt' key"),
        ('{"text": "\\"A\\""}', "line 2 of '.*' is not a JSON object with a 'prompt' key"),
        ('{"prompt": 3}', "line 2 of '.*': 'prompt' must be a non-empty string, got 3"),
        ('{"prompt": "  "}', "line 2 of '.*': 'prompt' must be a non-empty string"),
    ],
)
def test_bad_jsonl_rows_name_file_and_line(tmp_path, line, match):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "\\"A\\""}\n' + line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        load_prompts(p, field="data.val_prompts")
    assert str(e.value).startswith("data.val_prompts: ") and str(p) in str(e.value)


def test_jsonl_blank_quoted_target_is_refused(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "\\"A\\""}\n{"prompt": "a sign that says \\"\\""}\n')
    with pytest.raises(ValueError, match="line 2 of"):
        load_prompts(p, require_quoted=True)


def test_prompt_order_uses_the_seed_mixer():
    """Epoch e of run seed s is the permutation of the generator seeded with sample_seed(s, e, 0, PROMPT_ORDER)."""
    n, per, seed = 7, 3, 5
    got = torch.cat([step_prompt_indices(n, s, per, seed) for s in range(7)])  # 21 = epochs 0, 1, 2
    want = torch.cat(
        [
            torch.randperm(n, generator=torch.Generator().manual_seed(sample_seed(seed, e, 0, PROMPT_ORDER)))
            for e in range(3)
        ]
    )
    assert torch.equal(got, want)


def test_prompt_orders_of_neighbouring_run_seeds_do_not_overlap():
    # A linear mix seed * 1_000_003 + epoch gave run seed 1's epoch 0 to run seed 0's epoch 1_000_003.
    n = 50
    assert not torch.equal(step_prompt_indices(n, 1_000_003, n, seed=0), step_prompt_indices(n, 0, n, seed=1))


def test_step_prompt_indices_cover_each_epoch_once():
    n, per = 10, 4
    seen = torch.cat([step_prompt_indices(n, s, per, seed=3) for s in range(5)])  # 20 = two epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:])  # each epoch its own permutation


def test_step_prompt_indices_pure_function_of_step_and_seed():
    assert torch.equal(step_prompt_indices(7, 5, 3, seed=1), step_prompt_indices(7, 5, 3, seed=1))
    assert not torch.equal(step_prompt_indices(50, 0, 8, seed=1), step_prompt_indices(50, 0, 8, seed=2))


def test_load_prompts_formats_and_errors(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text('A sign that says "OPEN"\n\nA cup with "TEA" on it\n')
    assert load_prompts(txt, require_quoted=True) == ['A sign that says "OPEN"', 'A cup with "TEA" on it']
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a \\"B\\""}\n')
    assert load_prompts(jl) == ['a "B"']
    bad = tmp_path / "bad.txt"
    bad.write_text('fine "X"\nno quote here\n')
    with pytest.raises(ValueError, match="line 2.*no double-quoted"):
        load_prompts(bad, require_quoted=True)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(empty)
    with pytest.raises(FileNotFoundError, match="data.train_prompts"):
        load_prompts(tmp_path / "missing.txt")
