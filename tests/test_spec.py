"""Job spec: YAML, overrides, unknown keys, masking, schemas in sync, validate."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import local_writer, write_prompt_shards
from typer.testing import CliRunner

from batchspec.cli import app
from batchspec.schemas import rendered
from batchspec.spec import (
    SpecError,
    load_spec,
    normalised_path,
    parse_params,
    same_spec,
    spec_differences,
    spec_from_dict,
)

REPO = Path(__file__).resolve().parents[1]
BASE = {"name": "j", "input": {"path": "in/"}, "output": {"path": "out/"}, "model": {"target": "m"}}


def test_every_job_file_in_the_repo_is_valid():
    for job in (REPO / "jobs").glob("*.yaml"):
        assert load_spec(job).name.startswith("summarize_legal")


def test_overrides_parse_yaml_values():
    spec = spec_from_dict(BASE, ["generation.max_new_tokens=64", 'generation.stop=["\\n", "END"]',
                                 "model.draft.kind=ngram", "speculation.mode=off"])
    assert spec.generation.max_new_tokens == 64 and spec.generation.stop == ["\n", "END"]
    assert spec.model.draft.kind == "ngram" and spec.speculation.mode == "off"


def test_a_set_value_for_a_text_setting_is_its_text_even_where_yaml_reads_a_mapping():
    """YAML reads '{contract}' and 'Summary: {contract}' as mappings and refuses '{"a": 1} for:
    {contract}' (a traceback, before); on a text setting the user meant the text."""
    for template in ("{contract}", "Summary: {contract}", 'Return JSON like {"summary": "..."} for: {contract}',
                     "Summarize.\n{contract}\nSummary:"):
        assert spec_from_dict(BASE, [f"input.template={template}"]).input.template == template
    assert spec_from_dict(BASE, ["model.draft={kind: ngram}"]).model.draft.kind == "ngram"  # a mapping where one is meant
    with pytest.raises(SpecError, match="generation.max_new_tokens: Input should be a valid integer"):
        spec_from_dict(BASE, ["generation.max_new_tokens={x"])


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(SpecError, match=r"generation.max_new_token: unknown key; did you mean 'max_new_tokens'\?"):
        spec_from_dict({**BASE, "generation": {"max_new_token": 3}})
    with pytest.raises(SpecError, match="resourses: unknown key; did you mean 'resources'"):
        spec_from_dict({**BASE, "resourses": {}})


def test_bad_values_are_explained():
    with pytest.raises(SpecError, match="speculation.mode"):
        spec_from_dict({**BASE, "speculation": {"mode": "sometimes"}})
    with pytest.raises(SpecError, match="draft kind 'model' needs draft.path"):
        spec_from_dict({**BASE, "model": {"target": "m", "draft": {"kind": "model"}}})
    # vLLM refuses a temperature above 2 per request: refused here, before Ray and the engine load,
    # not as every shard failing after it (a demo run with temperature 3.0 did).
    with pytest.raises(SpecError, match="generation.temperature: Input should be less than or equal to 2"):
        spec_from_dict({**BASE, "generation": {"temperature": 3.0}})


def test_yaml_is_loaded_safely(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(job)


def test_parameters_fill_the_spec_and_a_missing_or_misspelt_one_is_named():
    """Issue 60: one spec for every night, `out/dt={ds}` with ds from the caller. input.template's
    {column} placeholders are the rows' columns, never parameters; {{name}} is the text itself."""
    data = {**BASE, "input": {"path": "in/dt={ds}/", "template": "Summarize {prompt}"},
            "output": {"path": "s3://b/out/dt={ds}/"}, "generation": {"stop": ["{{ds}}", '{"a": 1}']}}
    spec = spec_from_dict(data, params={"ds": "2026-12-05"})
    assert spec.input.path == "in/dt=2026-12-05" and spec.output.path == "s3://b/out/dt=2026-12-05"
    assert spec.input.template == "Summarize {prompt}" and spec.generation.stop == ["{ds}", '{"a": 1}']
    set_too = spec_from_dict(BASE, ["output.path=out/{ds}/{hour}"], params={"ds": "d", "hour": "07"})
    assert set_too.output.path == "out/d/07"
    with pytest.raises(SpecError, match=r"input.path has the parameter \{ds\} but no value for it: pass --param ds="):
        spec_from_dict(data)
    with pytest.raises(SpecError, match="--param dS is not a parameter of this spec"):
        spec_from_dict(data, params={"ds": "x", "dS": "y"})
    with pytest.raises(SpecError, match="--param expects name=value"):
        parse_params(["2026-12-05"])
    assert parse_params(["ds=2026-12-05", "note=a=b"]) == {"ds": "2026-12-05", "note": "a=b"}  # text, not a YAML date


def test_paths_are_normalised_so_a_trailing_slash_is_one_spec():
    a = spec_from_dict({**BASE, "input": {"path": "./in//"}, "output": {"path": "s3://bucket/out/"}})
    b = spec_from_dict({**BASE, "input": {"path": "in"}, "output": {"path": "s3://bucket/out"}})
    assert (a.input.path, a.output.path) == ("in", "s3://bucket/out") and a.output_hash() == b.output_hash()
    assert normalised_path("/") == "/" and normalised_path("s3://b/") == "s3://b" and normalised_path("in/*.parquet") == "in/*.parquet"
    recorded = {**b.masked(), "output": {**b.masked()["output"], "path": "s3://bucket/other"}}
    assert spec_differences(recorded, a) == ['output.path: "s3://bucket/other" there, "s3://bucket/out" here']
    assert same_spec({"spec_hash": "0" * 64, "spec": {**a.masked(), "output": {"path": "s3://bucket/out/"}}}, a)


def test_secrets_are_masked_and_do_not_change_the_output_hash():
    opts = {"endpoint_url": "http://x", "key": "AKIA123", "secret": "s3cr3t", "client_kwargs": {"aws_session_token": "t"}}
    a = spec_from_dict({**BASE, "input": {"path": "in/", "storage_options": opts}})
    b = spec_from_dict(BASE)
    masked = json.dumps(a.masked())
    assert "AKIA123" not in masked and "s3cr3t" not in masked and '"t"' not in masked and "http://x" in masked
    assert a.output_hash() == b.output_hash()
    assert spec_from_dict(BASE, ["resources.actors=4"]).output_hash() == b.output_hash()
    assert spec_from_dict(BASE, ["generation.seed=1"]).output_hash() != b.output_hash()


def test_schemas_in_repo_match_the_code():
    for name, text in rendered().items():
        assert (REPO / "schemas" / name).read_text() == text, f"run `batchspec schema` to regenerate {name}"


def _job(tmp_path, models_dir, **over) -> Path:
    data = {"name": "v", "input": {"path": str(tmp_path / "in"), "id_column": "doc_id"},
            "output": {"path": str(tmp_path / "out")}, "model": {"target": str(models_dir / "llama-target")}}
    for k, v in over.items():
        section, field = k.split("__")
        data[section][field] = v
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(data))
    return path


def test_validate_ok(models_dir, tmp_path):
    write_prompt_shards(local_writer(tmp_path / "in"), 2, 3)
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 0, res.output
    assert "prompts-0001" in res.output and "ok" in res.output
    assert "no input.id_column" not in res.output
    # Without an id column: what ids rows get, and the input's own id column named.
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir, input__id_column=None))])
    assert res.exit_code == 0 and "no input.id_column: each row's id is '<shard>:<row_index>'" in res.output
    assert "--set input.id_column=doc_id would use it" in res.output


def test_validate_catches_missing_column_and_bad_type(models_dir, tmp_path):
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 3)
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir, input__prompt_column="text"))])
    assert res.exit_code == 2 and "missing column 'text'" in res.output
    local_writer(tmp_path / "in")("ints.parquet", pa.table({"prompt": [1, 2], "doc_id": ["a", "b"]}))
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 2 and "is int64, not text" in res.output


def test_validate_takes_dictionary_encoded_text_as_text(models_dir, tmp_path):
    """pandas writes a Categorical column as dictionary<string>; submit reads its values as text,
    so validate must not refuse it (it did: "is dictionary<values=string, ...>, not text")."""
    import pandas as pd

    (tmp_path / "in").mkdir()
    pd.DataFrame({"prompt": pd.Categorical(["a contract", "another", "a contract"]), "doc_id": ["a", "b", "c"]}) \
        .to_parquet(tmp_path / "in" / "cat.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "in" / "cat.parquet").field("prompt").type)
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 0, res.output


def test_validate_names_ids_repeated_across_shards(models_dir, tmp_path):
    write = local_writer(tmp_path / "in")
    write("a.parquet", pa.table({"prompt": ["one", "two"], "doc_id": ["x", "y"]}))
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 0 and "repeated across shards" not in res.output, res.output
    write("b.parquet", pa.table({"prompt": ["three", "four"], "doc_id": ["z", "x"]}))
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 0 and "note: id 'x' is in shards a, b: ids repeated across shards" in res.output, res.output
    assert "repeated within" not in res.output and "null id" not in res.output, res.output


def test_validate_names_ids_repeated_within_a_shard_and_null_ids(models_dir, tmp_path):
    """The worker makes a repeated id's later rows and null-id rows error rows; validate says so first."""
    write = local_writer(tmp_path / "in")
    write("a.parquet", pa.table({"prompt": ["one", "two", "three", "four"], "doc_id": ["x", "y", "x", "x"]}))
    write("b.parquet", pa.table({"prompt": ["five", "six"], "doc_id": pa.array([None, "z"], pa.string())}))
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir))])
    assert res.exit_code == 0, res.output
    assert "note: id 'x' is repeated within shard a: 2 row(s) there will be error rows" in res.output, res.output
    assert "note: shard b has 1 row(s) with a null id in 'doc_id': they will be error rows" in res.output, res.output
    assert "repeated across shards" not in res.output, res.output


def test_validate_catches_unknown_key_and_unreachable_input(models_dir, tmp_path):
    job = _job(tmp_path, models_dir)
    data = json.loads(job.read_text())
    data["model"]["draf"] = {"kind": "ngram"}
    job.write_text(json.dumps(data))
    res = CliRunner().invoke(app, ["validate", str(job)])
    assert res.exit_code == 2 and "did you mean 'draft'" in res.output
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir, input__path=str(tmp_path / "nowhere")))])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_validate_catches_unresolvable_model(models_dir, tmp_path):
    write_prompt_shards(local_writer(tmp_path / "in"), 1, 2)
    res = CliRunner().invoke(app, ["validate", str(_job(tmp_path, models_dir, model__target=str(tmp_path / "no-model")))])
    assert res.exit_code == 2 and "target model" in res.output


def test_help_does_not_import_torch_or_ray():
    import subprocess
    import sys

    code = "import sys, batchspec.cli as c; sys.argv=['batchspec','--help']\ntry:\n c.main()\nexcept SystemExit: pass\n" \
           "print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False False")


def test_version_names_the_engines_without_importing_them():
    import subprocess
    import sys

    from batchspec import __version__

    code = "import sys, batchspec.cli as c; sys.argv=['batchspec','--version']\ntry:\n c.main()\nexcept SystemExit: pass\n" \
           "print('torch' in sys.modules, 'ray' in sys.modules, 'vllm' in sys.modules)"
    first, last = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert first.startswith(f"batchspec {__version__} (python ") and "torch 2." in first and "ray 2." in first
    assert last == "False False False"


def test_job_spec_doc_lists_every_field():
    from batchspec.schemas import job_spec_reference

    assert job_spec_reference() in (REPO / "docs" / "job-spec.md").read_text(), "regenerate the table in docs/job-spec.md"


def test_prompt_template_and_chat_format(models_dir):
    from transformers import AutoTokenizer

    from batchspec.runner.plan import Shard
    from batchspec.runner.read import validate_rows

    tok = AutoTokenizer.from_pretrained(models_dir / "llama-target")
    shard = Shard("s", "x.parquet", 0, 2, {})
    table = pa.table({"prompt": ["a lease", "an NDA"], "kind": ["lease", None], "doc_id": ["1", "2"]})
    spec = spec_from_dict({**BASE, "input": {"path": "in/", "id_column": "doc_id",
                                             "template": "Summarize this {kind}:\n{prompt}\nSummary:"}})
    rows = validate_rows(table, shard, spec, tok)
    assert [r.prompt for r in rows] == ["Summarize this lease:\na lease\nSummary:", "Summarize this :\nan NDA\nSummary:"]
    chat = pa.table({"prompt": [[{"role": "user", "content": "hi"}], [], [{"oops": 1}]], "doc_id": ["1", "2", "3"]})
    spec = spec_from_dict({**BASE, "input": {"path": "in/", "id_column": "doc_id", "format": "chat"}})
    rows = validate_rows(chat, Shard("s", "x", 0, 3, {}), spec, tok)
    assert rows[0].prompt == "<|bos|>user\nhi\n<|bos|>assistant\n" and rows[0].error is None
    assert rows[1].error == "empty chat prompt"
    assert rows[2].error.startswith("chat prompt must be a list")


def test_max_actors_below_actors_is_refused_with_what_to_do():
    from batchspec.spec import ResourcesSpec

    assert ResourcesSpec(actors=2, max_actors=4).max_actors == 4
    with pytest.raises(ValueError, match=r"max_actors \(1\) is fewer than actors \(2\).*leave it out for a fixed pool"):
        ResourcesSpec(actors=2, max_actors=1)
