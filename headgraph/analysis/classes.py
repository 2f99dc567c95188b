"""Known head classes (e.g. the IOI circuit of GPT-2 small), shipped as data and named by their source.

Built-in sets: `ioi` (Wang et al. 2023, headgraph/data/classes/ioi_wang2023.json) and `pk-paper` (the PK
paper's wider colouring, headgraph/data/classes/pk_paper.json). Your own file is JSON of this form:

    {
      "name": "my-classes",                       (optional; defaults to the file name)
      "model": "gpt2",                            (optional: the model the head names refer to)
      "source": "where the classes come from",    (optional; defaults to the file path)
      "classes": {"induction": ["L5H5", "L6H9"], "previous_token": ["L4H11"]}
    }

Head names are L{layer}H{head}; a head may be listed in more than one class.
"""

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from headgraph.errors import UsageError

BUILTIN = {"ioi": "ioi_wang2023.json", "pk-paper": "pk_paper.json"}
HEAD_NAME = re.compile(r"^L\d+H\d+$")


@dataclass(frozen=True)
class HeadClasses:
    """Named classes of heads, with the source they come from."""

    name: str
    source: str
    model: str | None
    classes: dict[str, tuple[str, ...]]

    @property
    def heads(self) -> frozenset[str]:
        """Every head in any class."""
        return frozenset(h for members in self.classes.values() for h in members)

    def classes_of(self, head: str) -> list[str]:
        """The classes a head belongs to (empty if none)."""
        return [name for name, members in self.classes.items() if head in members]

    def labels(self) -> dict[str, list[str]]:
        """{head: its class names} for every head in a class."""
        return {head: self.classes_of(head) for head in self.heads}


def _parse(data, origin: str) -> HeadClasses:
    if not isinstance(data, dict) or not isinstance(data.get("classes"), dict):
        raise UsageError(f"{origin}: expected a JSON object with a \"classes\" object of class -> list of heads")
    classes = {}
    for name, members in data["classes"].items():
        if not isinstance(members, list) or not all(isinstance(h, str) and HEAD_NAME.match(h) for h in members):
            raise UsageError(f"{origin}: class {name!r} must be a list of head names like \"L5H1\"")
        classes[name] = tuple(members)
    return HeadClasses(str(data.get("name", Path(origin).stem)), str(data.get("source", origin)),
                       data.get("model"), classes)


def default_classes(model: str) -> HeadClasses | None:
    """The known classes of a model, where the project ships them (GPT-2 small: the PK paper's colouring); None
    for every other model, which says nothing about whether it has classes."""
    return load_classes("pk-paper") if str(model).split("/")[-1] == "gpt2" else None


def load_classes(name_or_path: str) -> HeadClasses:
    """A built-in class set (`ioi`, `pk-paper`) or a JSON file of the documented form."""
    if name_or_path in BUILTIN:
        text = resources.files("headgraph").joinpath("data", "classes", BUILTIN[name_or_path]).read_text()
        return _parse(json.loads(text), BUILTIN[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise UsageError(f"unknown class set {name_or_path!r}: use {' or '.join(BUILTIN)} or the path of a JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return _parse(data, str(path))
