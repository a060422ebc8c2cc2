"""`bench.py pipeline` on the embedded default over 2 ranks (mlx.launch, loopback): its rows, its
Link counts per token, and replies equal to one process's."""

from __future__ import annotations

from scripts.benchmarks import pipeline

ENV = {"date": "d", "device": "cpu", "backend": "mlx", "mlx": "0", "commit": "c"}


def test_two_ranks_report_speeds_and_each_ranks_link_per_token_with_one_process_replies(capsys):
    res = pipeline.bench_pipeline(None, [2], tokens=4, prompt_tokens=40)
    one, (split,) = res["one"]["runs"], res["split"]
    assert split["ranks"] == 2 and set(split["runs"]) == set(one) == {"plain", "drafted"}
    for label, run in split["runs"].items():
        assert run["hash"] == one[label]["hash"] == one["plain"]["hash"]  # drafted = plain = one process
        assert run["decode_tok_s"] > 0 and run["prefill_tok_s"] > 0 and one[label]["decode_tok_s"] > 0
        assert len(run["links"]) == 2
        for link in run["links"]:
            for stretch in (link["prefill"], link["decode"]):
                assert all(stretch[name] >= 0 for name in ("ready_s", "send_s", "wait_s", "recv_s"))
                assert stretch["sent"] > 0 and stretch["received"] > 0 and stretch["sent_bytes"] > 0
        first, second = (link["decode"] for link in run["links"])  # per token: what one sent, the other got
        assert first["sent"] == second["received"] and first["sent_bytes"] == second["received_bytes"]
        assert second["sent_bytes"] == first["received_bytes"]
    names = [name for name, _, _ in split["runs"]["plain"]["decode_forward"]]
    assert names[0] == "tokens" and names[1].startswith("stream (") and "pre-mix" in names
    pipeline.print_pipeline(ENV, res, "the embedded tiny checkpoint")
    out = capsys.readouterr().out
    assert out.count("| yes |") == 2 and "| 2 | drafted | 1 |" in out
