"""benchmarks/*.py that are modes of benchmark.py: the wrapper runs the variants it names."""
import json

from benchmarks import quant_latency


def test_quant_latency_times_fp32_and_int8_eager_and_as_torchscript(tmp_path, capsys):
    out = tmp_path / "q.json"
    quant_latency.main(["--size", "48", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                        "--json", str(out)])
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["fp32", "fp32+script", "int8", "int8+script"]
    for r in result["variants"].values():
        assert "train" not in r and r["infer_1"]["median"] > 0 and r["infer_batch"]["median"] > 0
    assert "mobilenet_v3_large" in capsys.readouterr().out
