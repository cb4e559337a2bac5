"""Hydra composition: conf/ + recipes/ + command-line overrides -> typed `Config`.

Recipes live in `recipes/` at the repository root (where users look for them), not inside
conf/, so they are registered in Hydra's ConfigStore as group `recipe` with package
`_global_`: `+recipe=NAME` then merges the recipe over the whole config, and a recipe's own
`defaults: [override /model: x]` list swaps group options.

Multirun sweeps (`-m decode.instances=1,2,3`) are expanded here into one override list per
combination (the cartesian product, as Hydra's basic sweeper does) and each is composed on its
own; `validate` and `plan` then run once per combination.

Every failure comes back as a `Finding` naming the key (never a traceback): compose problems
are the user's input, not a pdtool bug.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import typing
from pathlib import Path
from typing import Any

from pdtool.paths import conf_dir, recipes_dir
from pdtool.rules.finding import Finding, error
from pdtool.schema import Config, ModelConfig


class ComposeError(Exception):
    """Composition failed; `findings` say why, with the key involved."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__("; ".join(f"{f.key}: {f.message}" for f in findings))
        self.findings = findings


def recipe_files(root: Path | None = None) -> dict[str, Path]:
    """Recipe name -> file, for every `*.yaml` in recipes/."""
    root = root or recipes_dir()
    return {p.stem: p for p in sorted(root.glob("*.yaml"))}


def recipe_description(path: Path) -> str:
    """A recipe's `description:` value, else its first header comment line."""
    text = path.read_text()
    m = re.search(r"^description:\s*(.+)$", text, re.MULTILINE)
    if m:
        return m.group(1).strip().strip("\"'")
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") and not s.startswith("# @package"):
            return s.lstrip("#").strip()
    return ""


def load_recipe(path: Path) -> Any:
    """A recipe file as a DictConfig. Raises ComposeError naming the file if it is not YAML."""
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: a user-edited file
        msg = " ".join(str(e).split())
        raise ComposeError(
            [error(f"recipe={path.stem}", f"{path} is not valid YAML: {msg}", "fix the file")]
        ) from e
    return node


def _register(overrides: list[str]) -> None:
    """Store the schemas, and the recipes the overrides select, in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from pdtool.schema import register

    cs = ConfigStore.instance()
    register(cs)
    wanted = {
        m.group(1) for o in overrides if (m := re.match(r"^\+{0,2}recipe=([^,]*)$", o.strip()))
    }
    if "" in wanted:
        raise ComposeError([error("recipe", "empty recipe name", "use +recipe=NAME")])
    # only the selected recipe is loaded: the others cost start-up time and a broken one
    # must not fail a compose that does not use it
    files = recipe_files()
    for name in sorted(wanted):
        if name not in files:
            raise ComposeError(
                [
                    error(
                        "recipe",
                        f"no recipe named {name!r} in {recipes_dir()}",
                        f"use one of: {', '.join(files) or '(none)'} (see `pdtool recipes`)",
                    )
                ]
            )
        cs.store(group="recipe", name=name, node=load_recipe(files[name]), package="_global_")


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """One override list per combination of the sweep overrides (`k=a,b`, `k=range(1,4)`).

    Raises ComposeError for an override that cannot be parsed.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except HydraException as e:
        raise ComposeError([error(_key_from_text(str(e)), _first_line(e), _OVERRIDE_FIX)]) from e
    axes: list[list[str]] = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep() or o.value_type == ValueType.GLOB_CHOICE_SWEEP:
                raise ComposeError(
                    [
                        error(
                            o.key_or_group,
                            f"{o.input_line!r}: only lists, choice() and range() sweeps are "
                            "supported",
                            "list the values, e.g. decode.instances=1,2,3",
                        )
                    ]
                )
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


_OVERRIDE_FIX = "write overrides as key=value, +key=value (new key) or ~key; see `pdtool --help`"


def compose_raw(overrides: list[str]) -> Any:
    """The composed DictConfig (struct mode, interpolations unresolved). Raises ComposeError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    except Exception as e:  # Hydra/OmegaConf raise many types; all are input errors here
        raise ComposeError([_finding_from_exception(e, overrides)]) from e
    finally:
        GlobalHydra.instance().clear()


def to_typed(raw: Any) -> Config:
    """DictConfig -> `Config` dataclass instance (resolves interpolations). Raises ComposeError."""
    from omegaconf import OmegaConf

    unknown = _unknown_keys(raw)
    if unknown:
        raise ComposeError(
            [
                error(k, f"'{k}' is not a pdtool setting", "remove it or check its spelling")
                for k in unknown
            ]
        )
    _fill_from_checkpoint(raw)
    try:
        obj = OmegaConf.to_object(raw)
    except Exception as e:
        raise ComposeError([_finding_from_exception(e)]) from e
    if not isinstance(obj, Config):
        raise ComposeError([error("<root>", "composed config is not a pdtool Config")])
    return obj


def _fill_from_checkpoint(raw: Any) -> None:
    """`model.*` keys left unset (`???`) are read from `model.path`'s config.json when it is a
    local checkpoint folder, so `model.path=DIR` alone describes the model (conf/model/
    hf-local.yaml); so are attention, context_length and dtype unless set to another value
    than their default. Raises ComposeError naming `model.path` when keys are unset and the folder
    cannot say what they are."""
    from omegaconf import OmegaConf

    from pdtool.arch import CheckpointError, plan_fields, read_arch

    model = raw.get("model")
    if model is None:
        return
    unset = [k for k in ModelConfig.__dataclass_fields__ if OmegaConf.is_missing(model, k)]
    if OmegaConf.is_missing(model, "path") or not model.get("path"):
        if len(unset) > 1:  # model=hf-local without its folder: name the one key that is due
            raise ComposeError([error(
                "model.path", f"not set, and the model's architecture ({', '.join(unset)}) "
                "is read from it", "set model.path=/path/to/checkpoint (a Llama, Qwen2 or Qwen3 "
                "folder: config.json, *.safetensors, tokenizer.json)")])
        return
    if not unset:
        return
    try:
        fields = plan_fields(read_arch(str(model.path)))
    except CheckpointError as exc:
        fix = ("point model.path at a Llama, Qwen2 or Qwen3 checkpoint folder, or set "
               f"{', '.join(f'model.{k}' for k in unset)}")
        hub = str(model.path)
        if re.fullmatch(r"[\w.-]+/[\w.-]+", hub) and not Path(hub).exists():
            # a Hugging Face Hub id: the reference engine reads a folder, it downloads nothing
            fix = (f"download it to a folder first (`hf download {hub} --local-dir "
                   f"~/models/{hub.split('/')[1]}`) and set model.path to that folder")
        raise ComposeError([error("model.path", str(exc), fix)]) from None
    defaults = ModelConfig.__dataclass_fields__
    for key, value in fields.items():  # keys with a default: the checkpoint's unless changed
        if OmegaConf.is_missing(model, key) or model[key] == defaults[key].default:
            model[key] = value


def load_config(overrides: list[str]) -> tuple[Config | None, list[Finding]]:
    """Compose and type a config: `(cfg, [])` or `(None, findings)` naming what is wrong.

    Only composition and typing problems are reported here; run `pdtool.rules.validate(cfg)`
    for the deployment rules.
    """
    try:
        return to_typed(compose_raw(overrides)), []
    except ComposeError as e:
        return None, e.findings


def load_job_config(folder: Path) -> Config:
    """The resolved config a job folder was rendered from (its `config.yaml`, secrets
    redacted), typed again: what runs inside the job knows the deployment without the
    overrides that made it. Raises ComposeError naming the file."""
    from omegaconf import OmegaConf

    path = Path(folder) / "config.yaml"
    try:
        raw = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    except Exception as e:
        raise ComposeError([error(str(path), f"cannot read the job's config: {_first_line(e)}",
                                  "give the folder `pdtool render` wrote")]) from e
    return to_typed(raw)


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (saved beside rendered scripts so a job is reproducible)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys added with `+key=...` (Hydra lets `+` bypass struct mode) that no schema has."""
    import dataclasses

    from omegaconf import DictConfig, ListConfig, OmegaConf

    out: list[str] = []
    if isinstance(node, DictConfig):
        typ = OmegaConf.get_type(node)
        names = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
        for k in node:
            key = f"{prefix}{k}"
            if names is not None and k not in names:
                out.append(key)
                continue
            child = node._get_node(k)
            if isinstance(child, DictConfig | ListConfig):
                out.extend(_unknown_keys(child, key + "."))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            child = node._get_node(i)
            if isinstance(child, DictConfig | ListConfig):
                out.extend(_unknown_keys(child, f"{prefix}{i}."))
    return out


# --- turning Hydra/OmegaConf exceptions into findings --------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _key_from_text(text: str) -> str:
    for pat in (
        r"Could not find '([\w-]+)/",
        r"argument '\+{0,2}([^=']+)=",
        r"full_key:\s*([\w.\[\]-]+)",
        r"[Kk]ey '([\w.\[\]/-]+)'",
        r"override '([^']+)'",
        r"Could not override '([^']+)'",
        r"Could not append to config\. An item is already at '([^']+)'",
        r"In '([\w/.-]+)'",
    ):
        m = re.search(pat, text)
        if m:
            return m.group(1)
    return "<command line>"


def _schema_node(key: str) -> Any:
    """The schema dataclass that holds `key` ('prefill.tpp' -> RoleConfig), or None where the
    path leaves the typed schema (e.g. launcher.env.*)."""
    node: Any = Config
    for part in key.split(".")[:-1]:
        node = typing.get_type_hints(node).get(part)
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
    return node


def _schema_fields(key: str) -> dict[str, dataclasses.Field] | None:
    node = _schema_node(key)
    return None if node is None else {f.name: f for f in dataclasses.fields(node)}


def _schema_type(key: str) -> str:
    """The schema's type of `key` as a user writes it ('an int', 'a list of str'), or ''."""
    node = _schema_node(key)
    hint = typing.get_type_hints(node).get(key.rsplit(".", 1)[-1]) if node else None
    if hint is None:
        return ""
    if typing.get_origin(hint) is list:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    name = getattr(hint, "__name__", str(hint))
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _schema_default(key: str) -> str:
    f = (_schema_fields(key) or {}).get(key.rsplit(".", 1)[-1])
    if f is None or f.default is dataclasses.MISSING or str(f.default).startswith("${"):
        return "<value>"
    return str(f.default).lower() if isinstance(f.default, bool) else str(f.default)


def _unknown_key_fix(key: str) -> str:
    """'did you mean prefill.tp?' and the keys the node has, for a key the schema lacks."""
    fields = _schema_fields(key)
    extra = "use +key=value only to add a key the schema does not have"
    if not fields:
        return f"check the spelling of '{key}'; {extra}"
    parent, _, leaf = key.rpartition(".")
    at = f"{parent}." if parent else ""
    close = difflib.get_close_matches(leaf, list(fields), n=1, cutoff=0.6)
    known = ", ".join(fields)
    meanings = f"`pdtool config --keys {at}` says what each means"
    if close:
        return (f"did you mean {at}{close[0]}? ({parent or 'the config'} has: {known}; "
                f"{meanings})")
    return f"{parent or 'the config'} has no '{leaf}'; its keys: {known} ({meanings}); {extra}"


def _group_option_fix(group: str, name: str) -> str:
    """The options of config group `group` (conf/<group>/*.yaml), the closest first."""
    folder = conf_dir() / group
    options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    if not options:
        return f"'{group}' is not a config group; see the folders in {conf_dir()}"
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{hint}{group} options: {', '.join(options)} (conf/{group}/)"


def _finding_from_exception(e: BaseException, overrides: list[str] | None = None) -> Finding:
    """The most specific key and message in an exception chain (and the overrides given)."""
    from omegaconf.errors import OmegaConfBaseException

    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    text = "\n".join(str(c) for c in chain)
    key = ""
    for c in chain:
        if isinstance(c, OmegaConfBaseException) and getattr(c, "full_key", None):
            key = str(c.full_key)
            break
    key = key or _key_from_text(text)
    if key == "<command line>" and overrides:
        # Hydra did not say which override: the one its message quotes, else the only one
        named = [o for o in overrides if o in text] or (overrides if len(overrides) == 1 else [])
        if named:
            key = re.sub(r"^[+~]+", "", named[0].split("=", 1)[0])
    msg = _first_line(e)
    root = _first_line(chain[-1])
    if root not in msg:
        msg = f"{msg}: {root}"
    m = re.search(r'in "([^"]+\.yaml)", line (\d+)', text)
    if m:  # a YAML syntax error in a config file: name the file and line
        return error(f"{m.group(1)}:{m.group(2)}", f"not valid YAML: {msg}", "fix the file")
    low = text.lower()
    if "missingmandatoryvalue" in type(e).__name__.lower() or "missing mandatory value" in low:
        fix = f"set {key}=<value> (or choose a recipe/group option that sets it)"
    elif key.startswith("launcher.env.") and "not in struct" in low:
        fix = "add variables one at a time: +launcher.env.<all|prefill|decode|router>.NAME=value"
    elif key == "recipe" and "defaults list" in low:
        fix = "select a recipe with a leading plus: +recipe=NAME"
    elif "not in struct" in low or "key not found" in low or "could not override" in low:
        fix = _unknown_key_fix(key)
    elif "could not find" in low and "recipe" in low:
        fix = "see `pdtool recipes` for the available names"
    elif m := re.search(r"Could not find '([\w-]+)/([^']*)'", text):
        key, fix = m.group(1), _group_option_fix(m.group(1), m.group(2))
    elif "lexernoviablealt" in low or "error parsing override" in low:
        m2 = re.search(r"(?:^|: |')[+~]{0,2}([\w./-]+)=", text)
        key = m2.group(1) if m2 else key
        fix = (
            "write overrides as key=value and quote values with special characters, e.g. "
            "\"transfer.provider='tcp;ofi_rxm'\" "
            "(or pick a group option: transfer=tcp)"
        )
    elif "ambiguous value" in low or "multirun" in low:
        fix = "sweeps (k=a,b) need -m/--multirun"
    elif (want := _schema_type(key)) and re.search(r"value '|invalid literal|valueerror|"
                                                   r"could not convert|cannot convert", low):
        fix = f"{key} takes {want}, e.g. {key}={_schema_default(key)}"
        msg = f"{msg} ({key} takes {want})" if want not in msg else msg
    else:
        fix = _OVERRIDE_FIX
    return error(key, msg, fix)
