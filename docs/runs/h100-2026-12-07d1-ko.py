#!/usr/bin/env python3
"""Knock-out variants of the decode step's block attention (attend_block of decode_attend.wgsl,
timing only, outputs wrong) from a WGSL dump: for the route_leaf_merge pipeline file of DUMP,
writes OUT/<variant>/<same file name> for Tuning::wgsl_override. k1 no P.V; k2 no softmax work
(maxima, exponentials; barriers kept); k3 no score work (key loads, dots, lane sums; barriers
kept); k4 no attention (attend_block returns at once)."""
import os, sys
dump, out = sys.argv[1], sys.argv[2]
names = [n for n in os.listdir(dump) if n.startswith("decode_route_leaf") and ".route_leaf" in n]
assert names, "no route_leaf pipeline in the dump"
EDITS = {
    "k1": [("                if (it < cn) {\n                    for (var hh = 0u; hh < GQ; hh++) {\n                        let pr",
            "                if (false && it < cn) {\n                    for (var hh = 0u; hh < GQ; hh++) {\n                        let pr")],
    "k2": [("        if (act && al < r_n * GQ) {", "        if (false && act && al < r_n * GQ) {"),
           ("        if (act && al < GQ) {\n            var m = NEG;", "        if (false && act && al < GQ) {\n            var m = NEG;"),
           ("        if (act) {\n            for (var e = al; e < CH * GQ; e += AW) {\n                let x = xs[xb + e];",
            "        if (false && act) {\n            for (var e = al; e < CH * GQ; e += AW) {\n                let x = xs[xb + e];")],
    "k3": [("if (it / LK < cn) { a = dots_key_shard(", "if (false && it / LK < cn) { a = dots_key_shard("),
           ("        if (act) {\n            for (var e = al; e < CH * GQ; e += AW) {\n                var a = 0.0;",
            "        if (false && act) {\n            for (var e = al; e < CH * GQ; e += AW) {\n                var a = 0.0;")],
    "k4": [("    let act = ib < NB;\n    let xb", "    if (true) { return; }\n    let act = ib < NB;\n    let xb")],
}
for name in names:
    text = open(os.path.join(dump, name)).read()
    for v, edits in EDITS.items():
        t = text
        for old, new in edits:
            assert t.count(old) == 1, (name, v, old[:60], t.count(old))
            t = t.replace(old, new)
        os.makedirs(os.path.join(out, v), exist_ok=True)
        open(os.path.join(out, v, name), "w").write(t)
    print("variants of", name)
