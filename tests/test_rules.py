"""Rules: matching by glob, regex and class (subclasses too), priority, built-ins, edits,
problem reports; and the precision report table."""

import re
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax import ModuleRow, Policy, PrecisionReport, Rule, Rules, get_policy
from mpjax import rules as rules_module

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
MIXED = get_policy("mixed_bfloat16")


class MyLayerNorm(nn.LayerNorm):
    pass


def test_default_applies_where_no_rule_matches():
    res = Rules(default="mixed_bfloat16").resolve("block_0/mlp/Dense_0", nn.Dense)
    assert res.policy == MIXED and res.rule is None and res.rule_name == "default"


@pytest.mark.parametrize(
    "key, path, matches",
    [
        ("block_*/mlp", "block_3/mlp", True),
        ("block_*/mlp", "block_3/mlp/Dense_0", False),
        ("block_*/mlp*", "block_3/mlp/Dense_0", True),
        ("*/attn", "encoder/layer_1/attn", True),  # fnmatch: * crosses '/'
        ("head", "head", True),
        ("head", "lm_head", False),
        (re.compile(r"block_\d+/attn"), "block_12/attn", True),
        (re.compile(r"block_\d+/attn"), "block_12/attn/query", False),  # full match only
        (re.compile(r"block_\d+/attn.*"), "block_12/attn/query", True),
    ],
)
def test_path_keys(key, path, matches):
    rules = Rules({key: "float32"}, default="mixed_bfloat16", builtins=False)
    assert (rules.resolve(path, nn.Dense).policy == get_policy("float32")) is matches


def test_path_may_be_a_sequence_of_names():
    rules = Rules({"block_0/mlp": "float16"}, builtins=False)
    assert rules.resolve(("block_0", "mlp"), nn.Dense).policy.compute_dtype == F16


def test_class_keys_match_subclasses_and_instances():
    rules = Rules({nn.LayerNorm: "float16"}, builtins=False)
    assert rules.resolve("x", MyLayerNorm).policy.compute_dtype == F16
    assert rules.resolve("x", MyLayerNorm()).policy.compute_dtype == F16
    assert rules.resolve("x", nn.Dense).rule is None


def test_first_match_wins():
    rules = Rules([("block_0/*", "float16"), (nn.Dense, "float32")], default="bf16")
    assert rules.resolve("block_0/d", nn.Dense).policy.compute_dtype == F16
    assert rules.resolve("block_1/d", nn.Dense).policy.compute_dtype == F32


@pytest.mark.parametrize(
    "norm",
    [
        nn.LayerNorm,
        nn.RMSNorm,
        nn.BatchNorm,
        nn.GroupNorm,
        nnx.LayerNorm,
        nnx.RMSNorm,
        nnx.BatchNorm,
        nnx.GroupNorm,
        MyLayerNorm,
    ],
)
@pytest.mark.parametrize("default", ["mixed_bfloat16", "bfloat16", "mixed_float16"])
def test_builtin_norm_rule_keeps_params_and_statistics_f32_output_compute(norm, default):
    default = get_policy(default)
    res = Rules(default=default).resolve("block/norm", norm)
    assert res.policy == Policy(F32, F32, default.compute_dtype)
    assert res.rule.builtin


def test_user_rules_take_precedence_over_builtins():
    rules = Rules({nn.LayerNorm: "bfloat16"}, default="mixed_bfloat16")
    assert rules.resolve("n", nn.LayerNorm).policy == get_policy("bfloat16")


def test_builtins_can_be_left_out_or_removed():
    assert Rules(default="bf16", builtins=False).resolve("n", nn.LayerNorm).rule is None
    rules = Rules(default="bf16").without(nn.LayerNorm)
    assert rules.resolve("n", nn.LayerNorm).rule is None
    assert rules.resolve("n", nn.RMSNorm).rule is not None


def test_with_rule_adds_first_or_after_user_rules_and_replaces_in_place():
    rules = Rules({"a": "f16"}, default="bf16")
    added = rules.with_rule("b", "f32")
    assert [r.name for r in added.rules[:2]] == ["b", "a"]
    appended = rules.with_rule("b", "f32", first=False)
    assert [r.name for r in appended.rules[:2]] == ["a", "b"] and appended.rules[2].builtin
    replaced = added.with_rule("a", "bf16")
    assert [r.name for r in replaced.rules[:2]] == ["b", "a"]
    assert replaced.resolve("a", nn.Dense).policy == get_policy("bf16")
    assert rules.resolve("a", nn.Dense).policy == get_policy("f16"), "rules are immutable"


def test_with_default():
    assert Rules().with_default("mixed_float16").default == get_policy("mixed_float16")


def test_callable_policy_gets_the_default():
    rules = Rules({"head": lambda d: d.with_compute_dtype(jnp.float32)}, default="mixed_bfloat16")
    assert rules.resolve("head", nn.Dense).policy == Policy(F32, F32, F32)


def test_attributes_from_user_rules():
    rules = Rules([("attn", None, {"precision": "highest"})], default="bf16")
    res = rules.resolve("attn", nn.Dense)
    assert res.policy == get_policy("bf16") and dict(res.attributes) == {"precision": "highest"}


def test_problems_report_never_matching_and_shadowed_rules():
    rules = Rules([("block_*", "f32"), ("block_0", "f16"), ("nowhere/*", "f16")], default="bf16")
    problems = rules.problems([("block_0", nn.Dense), ("block_1", nn.Dense), ("n", nn.LayerNorm)])
    assert problems == [
        "rule 'block_0' is ambiguous at 'block_0': rule 'block_*' comes first and wins there.",
        "rule 'nowhere/*' matches no module.",
    ]


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: Rules({"a": "p=f33"}), ValueError, "Unknown dtype name 'f33'"),
        (lambda: Rules({3: "f32"}), TypeError, "Rule key must be a path glob .*got 3 of type int"),
        (lambda: Rules({"  ": "f32"}), ValueError, "Rule key must not be empty"),
        (lambda: Rules([("a", "f32"), ("a", "f16")]), ValueError, "Duplicate rule keys: a"),
        (lambda: Rules(["a"]), TypeError, "Each rule must be a Rule or a \\(key, policy\\)"),
        (lambda: Rules().without("x"), ValueError, "No rule has key 'x'. Keys: re:"),
        (lambda: Rules(default="mixed_bf"), ValueError, "Unknown policy 'mixed_bf'"),
    ],
)
def test_bad_rules_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_as_rules():
    rules = Rules(default="bf16")
    assert mpjax.as_rules(rules) is rules
    made = mpjax.as_rules("mixed_float16")
    assert made.default == get_policy("mixed_float16") and any(r.builtin for r in made.rules)


def test_as_rules_takes_mappings_and_lists_of_rules_as_rules_does():
    mapping = {"head": "float32", nn.LayerNorm: "bf16"}
    assert mpjax.as_rules(mapping) == Rules(mapping)
    entries = [("head", "float32"), Rule(nn.Dense, "f16")]
    assert mpjax.as_rules(entries) == Rules(entries) == mpjax.as_rules(tuple(entries))
    assert mpjax.as_rules(mapping).default == get_policy("float32")


@pytest.mark.parametrize("spec", [3, None, {1, 2}, object()])
def test_as_rules_rejects_anything_else_naming_the_argument(spec):
    with pytest.raises(
        TypeError,
        match=r"^`policy_or_rules` must be mpjax.Rules, a policy .*"
        r"or a mapping or list of rules .*got ",
    ):
        mpjax.as_rules(spec)
    with pytest.raises(TypeError, match=r"^`rules` must be"):
        mpjax.as_rules(spec, "rules")


def test_integrations_register_their_norms_and_embeddings_in_order_with_stable_names():
    names = [r.name for r in Rules().rules]
    assert names == ["builtin: MoE router in f32"] + [
        name
        for lib, embed in (("linen", "Embed"), ("nnx", "Embed"), ("equinox", "Embedding"))
        for name in (
            *(f"builtin: {lib}.{norm} in f32" for norm in ("LayerNorm", "RMSNorm", "BatchNorm")),
            f"builtin: {lib}.GroupNorm in f32",
            f"builtin: {lib}.{embed} rows in the compute dtype",
        )
    ]
    assert [r.key for r in Rules().rules] == [
        rules_module.ROUTER_PATHS,
        nn.LayerNorm,
        nn.RMSNorm,
        nn.BatchNorm,
        nn.GroupNorm,
        nn.Embed,
        nnx.LayerNorm,
        nnx.RMSNorm,
        nnx.BatchNorm,
        nnx.GroupNorm,
        nnx.Embed,
        eqx.nn.LayerNorm,
        eqx.nn.RMSNorm,
        eqx.nn.BatchNorm,
        eqx.nn.GroupNorm,
        eqx.nn.Embedding,
    ]
    policies = {r.name: r.policy for r in Rules().rules}
    assert policies["builtin: linen.Embed rows in the compute dtype"] is mpjax.embedding_policy


def test_register_builtin_rule_appends_or_replaces_by_key(monkeypatch):
    monkeypatch.setattr(rules_module, "_BUILTIN_RULES", list(rules_module._BUILTIN_RULES))
    before = Rules(default="bf16")

    class Norm:
        pass

    rules_module.register_builtin_rule(Rule(Norm, rules_module.norm_policy, name="my norm"))
    after = Rules(default="bf16")
    assert after.rules[:-1] == before.rules and after.rules[-1].builtin
    assert after.resolve("n", Norm).policy == Policy(F32, F32, BF16)
    assert before.resolve("n", Norm).rule is None  # rules made earlier keep their rules
    rules_module.register_builtin_rule(Rule(Norm, "float16", name="my norm, f16"))
    again = Rules(default="bf16")
    assert len(again.rules) == len(after.rules)
    assert again.resolve("n", Norm).rule.name == "my norm, f16"
    with pytest.raises(TypeError, match=r"register_builtin_rule\(\) takes a Rule as `rule`"):
        rules_module.register_builtin_rule((Norm, "float16"))


def test_rules_and_rule_are_hashable_values():
    assert hash(Rule("a", "f32")) == hash(Rule("a", "f32"))
    assert Rules({"a": "f32"}, default="bf16") == Rules({"a": "f32"}, default="bf16")
    hash(Rules({"a": "f32"}))


def test_precision_report_table_and_totals():
    report = PrecisionReport(
        rows=(
            ModuleRow("", "GPT", MIXED, "default", 0, 0),
            ModuleRow(
                "block_0/norm", "LayerNorm", Policy(F32, F32, BF16), "builtin: LayerNorm", 256, 1024
            ),
            ModuleRow(
                "head",
                "Dense",
                Policy(F32, F32, F32),
                "head",
                1_000_000,
                4_000_000,
                matmuls=(("f32,f32@highest", 3),),
                computes=(("bf16", 1), ("f32", 12)),
            ),
        ),
        problems=("rule 'x' matches no module.",),
    )
    assert report.total_params == 1_000_256 and report.total_bytes == 4_001_024
    assert report.row("head").type_name == "Dense"
    with pytest.raises(KeyError, match="No module at path 'nope'"):
        report.row("nope")
    lines = str(report).splitlines()
    assert lines[0].split() == [
        "path",
        "type",
        "params",
        "compute",
        "output",
        "rule",
        "#params",
        "bytes",
        "ops",
        "ran",
        "in",
        "matmuls",
        "ran",
        "in",
    ]
    assert lines[2].split() == [
        "<root>",
        "GPT",
        "float32",
        "bfloat16",
        "float32",
        "default",
        "0",
        "0",
        "B",
        "-",
        "-",
    ]
    assert lines[3].split()[:5] == ["block_0/norm", "LayerNorm", "float32", "float32", "bfloat16"]
    # The dtypes the head's operations computed in, then its matmuls with their counts.
    assert lines[4].endswith("1,000,000  3.8 MiB  bf16 f32    3x f32,f32@highest")
    assert lines[6].split() == ["total", "1,000,256", "3.8", "MiB"]
    assert lines[7] == "warning: rule 'x' matches no module."


def test_describe_rejects_what_it_cannot_describe_listing_what_it_can():
    with pytest.raises(TypeError, match=r"describe\(\) takes .*; got <object") as error:
        mpjax.describe(object())
    kinds = ("a function made by mpjax.autocast", "a flax.linen module", "a flax.nnx module")
    for kind in (*kinds, "an equinox module"):
        assert kind in str(error.value)


def test_describe_says_which_import_describes_flax_modules(monkeypatch):
    # As with Flax installed but neither mpjax.linen nor mpjax.nnx imported.
    describing = sys.modules["mpjax.inspection.describe"]
    unregistered = [d for d in describing._describers if "autocast" in d.kind]
    monkeypatch.setattr(describing, "_describers", unregistered)
    monkeypatch.setattr(describing, "_packages", set())
    for model in (nn.Dense(2), nnx.Linear(2, 2, rngs=nnx.Rngs(0))):
        with pytest.raises(
            TypeError,
            match=r"takes a function made by mpjax\.autocast; got a "
            rf"{type(model).__name__}\. Flax modules are described "
            r"once mpjax\.linen \(linen\) or mpjax\.nnx \(NNX\)",
        ):
            mpjax.describe(model)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: Rules(None),
            r"Rules\(rules\): rules must be a mapping .*got None of type NoneType",
        ),
        (lambda: Rules(5), r"Rules\(rules\): rules must be a mapping .*got 5 of type int"),
        (
            lambda: Rules("head"),
            r"Rules\(rules\): rules must be a mapping .*got 'head' of type str",
        ),
        (
            lambda: Rules([("head", "float32", 5)]),
            r"Rule attributes for 'head' must be a mapping .*got 5 of type int",
        ),
        (
            lambda: Rules([("head", "float32", {1: 2})]),
            r"Rule attributes for 'head' must be named by str, got \[1\]",
        ),
        (
            lambda: Rules({re.compile(b"head"): "float32"}),
            r"bytes regular expression; module paths are str: use re.compile\('head'\)",
        ),
    ],
)
def test_malformed_rules_fail_where_they_are_written(make, message):
    with pytest.raises(TypeError, match=message):
        make()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: mpjax.norm_policy(None), TypeError, r"norm_policy\(default\): default must be"),
        (lambda: mpjax.norm_policy(3), TypeError, r"default must be a policy.*got 3 of type int"),
        (lambda: Rules(default=None), TypeError, r"Rules\(default=...\) must be a policy.*None"),
        (lambda: Rules({"a": 3}), TypeError, r"Rule policy for 'a' must be a policy.*got 3"),
        (lambda: Rules(builtins="yes"), TypeError, r"Rules\(builtins=...\) must be a bool"),
        (lambda: Rule("a", name=3), TypeError, r"Rule name for 'a' must be a str.*got 3"),
        (lambda: Rule("a", builtin="no"), TypeError, r"Rule builtin for 'a' must be a bool"),
        (lambda: Rules().resolve(None, nn.Dense), TypeError, r"resolve\(path, ...\): path must"),
        (lambda: Rules().resolve(3, nn.Dense), TypeError, r"path must be .*got 3 of type int"),
        (lambda: Rules().resolve("a", None), TypeError, r"module_type must be .*got None"),
        (lambda: Rules().with_rule("a", first="x"), TypeError, r"with_rule\(first=...\)"),
        (lambda: Rules().with_default(None), TypeError, r"with_default\(policy\) must be"),
        (lambda: Rules().problems(3), TypeError, r"problems\(modules\): modules must be"),
        (lambda: Rules().problems([3]), TypeError, r"each entry must be a \(path, class\) pair"),
    ],
)
def test_bad_arguments_raise_errors_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_norm_policy_takes_any_policy_spelling():
    expected = Policy(F32, F32, jnp.bfloat16)
    assert mpjax.norm_policy("mixed_bfloat16") == mpjax.norm_policy(mpjax.MIXED_BFLOAT16)
    assert mpjax.norm_policy("mixed_bfloat16") == expected


def test_allow_unmatched_is_kept_by_every_derived_rules_and_must_be_a_bool():
    rules = Rules({"head": "float32"}, allow_unmatched=True)
    derived = (
        rules.with_rule("body", "bf16"),
        rules.without("head"),
        rules.with_default("mixed_bfloat16"),
    )
    assert all(r.allow_unmatched for r in derived) and not Rules({}).allow_unmatched
    with pytest.raises(TypeError, match=r"allow_unmatched=\.\.\.\) must be a bool, got 'yes'"):
        Rules({}, allow_unmatched="yes")


def test_with_keys_rewrites_keys_in_order_even_where_a_user_rule_shares_a_builtin_class():
    rules = Rules({nn.Embed: "float32", "head": "bf16"}, default="mixed_bfloat16")
    upper = rules.with_keys(lambda key: key.upper() if isinstance(key, str) else key)
    assert [r.key for r in upper.rules][:2] == [nn.Embed, "HEAD"]
    assert [r.builtin for r in upper.rules] == [r.builtin for r in rules.rules]
    assert upper.resolve("x", nn.Embed).policy == get_policy("float32")  # the user's rule first
    assert upper.default == rules.default


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.fc2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


_MODELS = {
    "linen": lambda: _LinenMLP(),
    "nnx": lambda: _NnxMLP(nnx.Rngs(0)),
    "equinox": lambda: eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)),
}
_MISSPELLED = {"linen": "fc3", "nnx": "fc3", "equinox": "layers[3]"}


@pytest.mark.parametrize("library", sorted(_MODELS))
@pytest.mark.parametrize(
    "call, public",
    [
        (lambda model, rules, x: mpjax.describe(model, rules=rules)(x), "mpjax.describe()"),
        (lambda model, rules, x: mpjax.diagnose(model, policy=rules)(x), "mpjax.diagnose()"),
    ],
    ids=["describe", "diagnose"],
)
def test_a_rule_matching_nothing_names_the_call_the_user_made(library, call, public):
    # describe and diagnose set the rules on a copy with the integration's own function
    # (mpjax.nnx.set_policy, mpjax.linen.apply_policy...): the error names the user's call, and
    # the doctor passes it on as it is, not as inputs the model cannot run on.
    x = jnp.ones((4,)) if library == "equinox" else jnp.ones((3, 4))
    rules = Rules({_MISSPELLED[library]: "float32"}, default="mixed_float16")
    with pytest.raises(rules_module.UnmatchedRuleError) as error:
        call(_MODELS[library](), rules, x)
    message = str(error.value)
    assert message.startswith(f"{public}: rule {_MISSPELLED[library]!r} matches no module")
    assert "set_policy" not in message and "apply_policy" not in message
    assert "cannot run on these inputs" not in message


def test_describe_checks_an_nnx_models_rules_without_inputs():
    with pytest.raises(ValueError, match=r"^mpjax.describe\(\): rule 'fc3'.*closest paths"):
        mpjax.describe(_NnxMLP(nnx.Rngs(0)), rules=Rules({"fc3": "float32"}))


def test_the_integrations_own_calls_still_name_themselves():
    with pytest.raises(ValueError, match=r"^mpjax.nnx.set_policy\(\): rule 'fc3'"):
        mpjax.nnx.set_policy(_NnxMLP(nnx.Rngs(0)), Rules({"fc3": "float32"}))
    model = mpjax.linen.apply_policy(_LinenMLP(), Rules({"fc3": "float32"}))
    with pytest.raises(ValueError, match=r"^mpjax.linen.apply_policy\(\): rule 'fc3'"):
        model.init(jax.random.key(0), jnp.ones((3, 4)))


@pytest.mark.parametrize(
    "path, routes",
    [
        ("moe/router", True),
        ("h0/mlp/gate", True),  # Mixtral's, Qwen's and DeepSeek's name
        ("h_0/MoELayer_0/Router_0/Dense_0", True),  # linen's automatic names, and inside
        ("layers[3].moe.gate", True),  # Equinox's path syntax
        ("blocks/2/moe/router/kernel_proj", True),
        ("mlp/gate_proj", False),  # a gated MLP's projection
        ("gateway", False),
        ("router_head_sampler", False),
        ("mlp/up", False),
    ],
)
def test_the_builtin_router_rule_keeps_routers_in_float32(path, routes):
    resolution = Rules(default="mixed_bfloat16").resolve(path, nn.Dense)
    assert (resolution.rule_name == "builtin: MoE router in f32") is routes
    if routes:
        assert resolution.policy == get_policy("p=f32,c=f32,o=f32")
    # A user's rule comes first: the router runs as the user says.
    mine = Rules({"*router*": "mixed_bfloat16"}, default="float32").resolve(path, nn.Dense)
    if "router" in path:  # the glob is case-sensitive, as fnmatch is
        assert mine.policy == MIXED and mine.rule_name == "*router*"
