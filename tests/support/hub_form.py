"""The spawn form's inputs: a staff user, the profiles offered, and a form parsed as the
spawner parses it."""

from __future__ import annotations

from html.parser import HTMLParser

from hubplugin.options import GPUPermissions, load_profiles

STAFF = GPUPermissions(max_gpus=4, groups=["staff"])


PROFILES = load_profiles([
    {"slug": "cpu", "display_name": "CPU only", "description": "For light work"},
    {"slug": "one-1070", "display_name": "One GTX 1070", "mode": "exclusive", "model": "1070",
     "default": True},
    {"slug": "small-share", "display_name": "Small share", "mode": "shared", "model": "1070",
     "share_memory_mib": 2048},
])


class FormParser(HTMLParser):
    """Collects the form controls as a browser would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, str | None]] = []
        self.selects: dict[str, list[dict[str, str | None]]] = {}
        self._select: str | None = None
        self._option: dict[str, str | None] | None = None
        self.scripts = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "input":
            self.inputs.append(a)
        elif tag == "select":
            self._select = a.get("name") or ""
            self.selects[self._select] = []
        elif tag == "option" and self._select is not None:
            self._option = {**a, "text": ""}
            self.selects[self._select].append(self._option)
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        if tag == "option":
            self._option = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._option is not None:
            self._option["text"] = (self._option["text"] or "") + data

    def radios(self, name: str) -> list[dict[str, str | None]]:
        return [i for i in self.inputs if i.get("type") == "radio" and i.get("name") == name]

    def checked(self, name: str) -> str | None:
        for radio in self.radios(name):
            if "checked" in radio:
                return radio.get("value")
        return None

    def selected(self, name: str) -> str | None:
        options = self.selects[name]
        for option in options:
            if "selected" in option:
                return option.get("value")
        return options[0].get("value") if options else None

    def submit(self) -> dict[str, list[str]]:
        """The fields a browser submits with the defaults untouched (JS not run)."""
        data: dict[str, list[str]] = {}
        for name in ("profile", "mode"):
            value = self.checked(name)
            if value is not None:
                data[name] = [value]
        for name in self.selects:
            value = self.selected(name)
            if value is not None:
                data[name] = [value]
        for i in self.inputs:
            if i.get("type") == "number" and i.get("value"):
                data[str(i["name"])] = [str(i["value"])]
        return data


def parse(html: str) -> FormParser:
    parser = FormParser()
    parser.feed(html)
    parser.close()
    return parser
