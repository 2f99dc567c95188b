"""Known head classes and the PK/CS evaluation against them (Figure-1 counts, ROC-AUC, PR-AUC)."""

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from headgraph.analysis import evaluation as E
from headgraph.analysis.classes import HeadClasses, load_classes
from headgraph.cli import main
from headgraph.errors import UsageError


def test_builtin_classes_match_the_method_note():
    ioi = load_classes("ioi")
    assert len(ioi.heads) == 26 and "Wang" in ioi.source and ioi.model == "gpt2"
    assert ioi.classes["name_mover"] == ("L9H9", "L10H0", "L9H6")
    pk = load_classes("pk-paper")
    assert "2601.10266" in pk.source and len(pk.heads) == 39
    assert pk.heads > ioi.heads and pk.classes_of("L4H7") == ["identity"]
    assert set(pk.classes["induction"]) - set(ioi.classes["induction"]) == {"L5H0", "L5H1", "L7H2", "L7H10"}


def test_user_class_file(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"classes": {"a": ["L0H1", "L1H0"], "b": ["L1H0"]}}))
    c = load_classes(str(f))
    assert c.name == "mine" and c.source == str(f) and c.heads == {"L0H1", "L1H0"}
    assert c.classes_of("L1H0") == ["a", "b"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"heads": ["L0H1"]}), '"classes"'),
    (json.dumps({"classes": {"a": ["layer0head1"]}}), "head names"),
])
def test_bad_class_files_are_one_line_usage_errors(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_classes(str(f))


def test_unknown_class_set():
    with pytest.raises(UsageError, match="ioi or pk-paper"):
        load_classes("nope")


@pytest.mark.parametrize("seed", range(5))
def test_auc_and_average_precision_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    scores = np.round(rng.normal(size=300), 1)  # rounding makes ties
    labels = rng.random(300) < 0.2 + 0.1 * (scores > 0)
    assert E.roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert E.average_precision(scores, labels) == pytest.approx(average_precision_score(labels, scores), abs=1e-12)


def test_auc_is_undefined_without_both_classes():
    assert np.isnan(E.roc_auc(np.arange(4.0), np.zeros(4, bool)))
    assert np.isnan(E.average_precision(np.arange(4.0), np.zeros(4, bool)))


def _pairs():
    """All earlier->later pairs of a 3-layer, 2-head model for OQ, OK, OV, plus QQ; PK = a known function."""
    rows = []
    for st, tt in [("O", "Q"), ("O", "K"), ("O", "V"), ("Q", "Q")]:
        for sl in range(3):
            for tl in range(sl + 1, 3):
                for sh in range(2):
                    for th in range(2):
                        rows.append({"source": f"L{sl}H{sh}", "target": f"L{tl}H{th}", "source_layer": sl,
                                     "source_head": sh, "target_layer": tl, "target_head": th,
                                     "source_type": st, "target_type": tt})
    pairs = pd.DataFrame(rows)
    # PK is highest for pairs into L2H1, then by source; CS is undefined for QQ and reversed in order
    pairs["pk"] = 10 * (pairs["target"] == "L2H1") + pairs["source_layer"] + 0.1 * pairs["source_head"]
    pairs["cs"] = np.where(pairs["source_type"] == "Q", np.nan, -pairs["pk"])
    return pairs


def test_top_k_union_counts_in_and_out_of_class():
    pairs = _pairs()
    classes = HeadClasses("t", "test", None, {"x": ("L2H1", "L1H1")})
    edges = E.top_k_edges(pairs, "pk", k=2)
    # per type the two best pairs are L1H1->L2H1 and L1H0->L2H1
    assert len(edges) == 6 and set(edges["target"]) == {"L2H1"} and set(edges["source"]) == {"L1H1", "L1H0"}
    assert E.in_class_counts(pairs, classes, "pk", k=2) == {"in_class": 2, "out_of_class": 1}
    assert E.in_class_counts(pairs, classes, "pk", k=3) == {"in_class": 2, "out_of_class": 2}  # + L0H1


def test_evaluate_pairs_per_type_and_pooled():
    pairs = _pairs()
    classes = HeadClasses("t", "test", None, {"x": ("L2H1", "L1H1", "L1H0")})
    table = E.evaluate_pairs(pairs, classes, k=2).set_index(["metric", "scope"])
    assert list(table.index.get_level_values("scope")[:4]) == ["OQ", "OK", "OV", "all"]
    pk_all, cs_all = table.loc[("pk", "all")], table.loc[("cs", "all")]
    assert pk_all["pairs"] == 36 and pk_all["positives"] == 3 * 2  # L1H0 -> L2H1 and L1H1 -> L2H1, per type
    labels = E.both_in_class(E.typed_pairs(pairs), classes)
    typed = E.typed_pairs(pairs)
    assert pk_all["roc_auc"] == pytest.approx(roc_auc_score(labels, typed["pk"]))
    assert cs_all["roc_auc"] == pytest.approx(1 - pk_all["roc_auc"])
    assert cs_all["pr_auc"] == pytest.approx(average_precision_score(labels, typed["cs"]))
    assert ("pk", "QQ") not in table.index


def test_evaluate_pairs_needs_the_types():
    pairs = _pairs()
    with pytest.raises(UsageError, match="no pairs of type"):
        E.evaluate_pairs(pairs[pairs["source_type"] == "Q"], load_classes("ioi"))


def test_evaluate_command(tmp_path, capsys):
    _pairs().to_parquet(tmp_path / "pairs.parquet")
    classes = tmp_path / "c.json"
    classes.write_text(json.dumps({"source": "unit test", "classes": {"x": ["L2H1", "L1H1", "L1H0"]}}))
    main(["evaluate", str(tmp_path), "--classes", str(classes), "--top-k", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    rows = {(r["metric"], r["scope"]): r for r in out["rows"]}
    assert out["classes"]["source"] == "unit test"
    assert rows[("pk", "all")]["in_class"] == 3 and rows[("pk", "all")]["out_of_class"] == 0


def test_evaluate_command_without_pairs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "pairs.parquet" in capsys.readouterr().err


@pytest.mark.parametrize("damage, message", [
    (lambda path: path.write_bytes(b"not a parquet file"), "cannot read"),
    (lambda path: pd.DataFrame({"pk": [1.0]}).to_parquet(path), "lacks columns source, target, source_type"),
])
def test_evaluate_command_with_a_damaged_pairs_file(tmp_path, capsys, damage, message):
    damage(tmp_path / "pairs.parquet")
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "internal error" not in err


def _effect_pairs(n=120, seed=0):
    """OQ/OK/OV pairs whose effect follows PK in OK, nothing in OQ; effect_lo a fixed margin below."""
    rng = np.random.default_rng(seed)
    frames = []
    for kind in "QKV":
        pk = rng.gamma(2.0, 1.0, n)
        effect = 0.02 * pk + rng.normal(0, 0.01, n) if kind == "K" else rng.uniform(0, 0.1, n)
        frames.append(pd.DataFrame({"source": [f"L0H{i}" for i in range(n)], "target": "L1H0", "source_type": "O",
                                    "target_type": kind, "pk": pk, "cs": pk + rng.normal(0, 1, n),
                                    "effect": effect, "effect_lo": effect - 0.01}))
    return pd.concat(frames, ignore_index=True)


def test_causal_evaluation_matches_scipy_and_sklearn():
    from scipy.stats import spearmanr

    pairs = _effect_pairs()
    table = E.causal_evaluation(pairs, threshold=0.05, k=10, n_boot=400).set_index(["metric", "scope"])
    for metric in ("pk", "cs"):
        for kind in "QKV":
            part = pairs[pairs.target_type == kind]
            row = table.loc[(metric, f"O{kind}")]
            labels = (part.effect_lo > 0.05).to_numpy()
            assert row.causal == labels.sum() and row.base_rate == pytest.approx(labels.mean())
            assert row.spearman == pytest.approx(spearmanr(part[metric], part.effect).statistic)
            assert row.spearman_lo <= row.spearman <= row.spearman_hi
            assert row.roc_auc == pytest.approx(roc_auc_score(labels, part[metric]))
            assert row.pr_auc == pytest.approx(average_precision_score(labels, part[metric]))
            top = part.nlargest(10, metric)
            assert row.precision_at_k == pytest.approx((top.effect_lo > 0.05).mean())
            top_c = part.nlargest(int(labels.sum()), metric)
            assert row.r_precision == pytest.approx((top_c.effect_lo > 0.05).mean())
    ok, oq = table.loc[("pk", "OK")], table.loc[("pk", "OQ")]
    assert ok.spearman_lo > 0.8 and ok.roc_auc > 0.9  # the planted dependence is found ...
    assert oq.spearman_lo < 0 < oq.spearman_hi  # ... and none where there is none


def test_causal_evaluation_needs_effects():
    with pytest.raises(UsageError, match="no causal effects"):
        E.causal_evaluation(_effect_pairs().drop(columns=["effect", "effect_lo"]))


def test_resampled_ranks_are_scipys_average_ranks_of_each_resample():
    from scipy.stats import rankdata

    rng = np.random.default_rng(1)
    x = np.round(rng.normal(size=200), 1)  # many ties
    x[:3] = x.min() - 1  # and a group of ties ranked first
    counts = rng.multinomial(200, np.full(200, 1 / 200), size=5).astype(float)  # [resamples, items]
    for work in (None, (np.full_like(counts, np.nan), np.full_like(counts, np.nan))):
        ranks = E._resampled_ranks(E._ranking(x), counts, work)
        for b in range(5):
            items = np.repeat(np.arange(200), counts[b].astype(int))
            np.testing.assert_allclose(ranks[b, items], rankdata(x[items]))
    distinct = rng.permutation(200).astype(float)  # no ties: the other branch
    ranks = E._resampled_ranks(E._ranking(distinct), counts)
    items = np.repeat(np.arange(200), counts[0].astype(int))
    np.testing.assert_allclose(ranks[0, items], rankdata(distinct[items]))


@pytest.mark.parametrize("drawn_at_once", [E.DRAWN_AT_ONCE, 660])
def test_spearman_interval_is_the_percentile_interval_of_scipys_rho_on_each_resample(monkeypatch, drawn_at_once):
    """All 300 resamples in one block, and (660 draws at once) in blocks of 11 resamples."""
    from scipy.stats import spearmanr

    monkeypatch.setattr(E, "DRAWN_AT_ONCE", drawn_at_once)
    rng = np.random.default_rng(2)
    y = rng.gamma(1.0, size=60)
    xs = [np.round(y + rng.normal(size=60), 1), rng.normal(size=60)]  # ties, and no dependence
    got = E.spearman_intervals(xs, y, n_boot=300, seed=7)
    block, stream = max(1, drawn_at_once // 60), np.random.default_rng(7)  # resample b draws pairs draws[b]
    draws = np.concatenate([stream.integers(0, 60, size=(min(block, 300 - s), 60)) for s in range(0, 300, block)])
    for x, (rho, lo, hi) in zip(xs, got):
        boot = [spearmanr(x[d], y[d]).statistic for d in draws]
        assert rho == pytest.approx(spearmanr(x, y).statistic)
        assert (lo, hi) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])), abs=1e-12)
