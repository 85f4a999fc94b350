"""The ``api-modules`` directive: one ``automodule`` for every module of a package.

The API pages name packages, not modules, so a module added to the code is on its page at the
next build without anyone listing it::

    .. api-modules:: airflow_gpu_resilience.hooks

    .. api-modules:: airflow_gpu_resilience
       :flat:
       :exclude: compat get_provider_info

``:flat:`` takes only the package's own modules, not those of its subpackages; ``:exclude:``
leaves out modules by their name relative to the package. The package's own docstring comes
first unless ``:flat:`` is given.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import importlib
import inspect
import pkgutil

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def package_modules(package: str, *, flat: bool = False, exclude: frozenset[str] = frozenset()) -> list[str]:
    """The dotted names of ``package``'s modules, sorted, without ``__main__`` modules.

    :param package: an importable package, e.g. ``"airflow_gpu_resilience.hooks"``.
    :param flat: only the package's own modules, no subpackage or module below one.
    :param exclude: names relative to ``package`` to leave out (a subpackage with everything in it).
    :return: dotted module names; the package itself first unless ``flat``.
    :raises ValueError: ``package`` is a module, not a package.
    """
    module = importlib.import_module(package)
    if not hasattr(module, "__path__"):
        raise ValueError(f"api-modules: {package!r} is a module, not a package")
    names = [] if flat else [package]
    walk = pkgutil.iter_modules(module.__path__, package + ".") if flat else pkgutil.walk_packages(
        module.__path__, package + ".")
    for info in walk:
        relative = info.name[len(package) + 1:]
        if relative.split(".")[-1] == "__main__" or (flat and info.ispkg):
            continue
        if any(relative == name or relative.startswith(name + ".") for name in exclude):
            continue
        names.append(info.name)
    return sorted(names, key=lambda name: (name != package, name))


class ApiModules(SphinxDirective):
    """Expands to ``.. automodule::`` for each of :func:`package_modules`, each under its own heading."""

    required_arguments = 1
    option_spec = {"flat": directives.flag, "exclude": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        exclude = frozenset((self.options.get("exclude") or "").split())
        names = package_modules(self.arguments[0], flat="flat" in self.options, exclude=exclude)
        lines = StringList()
        source = self.get_source_info()[0]
        for name in names:
            # a package's own page shows its docstring only: the names it re-exports are documented
            # where they are defined, once
            options = ["   :no-members:"] if hasattr(importlib.import_module(name), "__path__") else []
            for line in (f"``{name}``", "-" * (len(name) + 4), "", f".. automodule:: {name}", *options, ""):
                lines.append(line, source)
        container = nodes.container()
        nested_parse_with_titles(self.state, lines, container)
        return container.children


#: The packages whose objects the reference resolution below looks among.
OWN_PACKAGES = ("airflow_gpu_resilience", "gpu_resilience_worker", "gpu_resilience_trainer")


def _find(dotted: str):
    """The object a dotted name denotes, importing its module; ``None`` when there is none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except (ImportError, ValueError, TypeError):
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


@functools.cache
def _imports(module: str) -> dict[str, str]:
    """``{local name: dotted name}`` of every ``import`` in ``module``'s source, also those under
    ``if TYPE_CHECKING:`` (names an annotation uses that do not exist at run time)."""
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return {}
    found = {}
    package = module if hasattr(importlib.import_module(module), "__path__") else module.rpartition(".")[0]
    for statement in ast.walk(ast.parse(source)):
        if isinstance(statement, ast.ImportFrom):
            base = statement.module or ""
            if statement.level:  # relative: from the module's own package, or one above it
                parent = package.rsplit(".", statement.level - 1)[0] if statement.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in statement.names:
                found[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                top = alias.name.split(".")[0]
                found[alias.asname or top] = alias.name if alias.asname else top
    return found


#: What a role may point at, for the roles whose target kind an object shows.
_ROLE_CHECKS = {"mod": inspect.ismodule, "class": inspect.isclass, "exc": inspect.isclass}
#: Values whose class says nothing of where they belong (a constant of this project is a ``str``).
_PLAIN = (str, bytes, int, float, bool, tuple, list, dict, set, frozenset, type(None))


def home_of(target: str, module: str, cls: str, role: str = "obj") -> str | None:
    """Where the object that ``target`` names, written in ``module`` (inside class ``cls``), is
    defined: ``module.qualname``, or ``None`` when it cannot be found.

    The name is looked up as the code reads it: as written, in the class, in the module (a name
    the module imported, also one imported for type checking only, or re-exports). A builtin's
    name (``int`` in an annotation) is left alone, and so is a candidate of the wrong kind for
    ``role`` (an attribute for ``:mod:``).
    """
    if "." not in target and hasattr(builtins, target):
        return None
    head, _, rest = target.partition(".")
    imported = _imports(module).get(head) if module else None
    package = module.rpartition(".")[0]
    candidates = [target] + [f"{prefix}.{target}" for prefix in (f"{module}.{cls}" if cls else "", module, package)
                             if prefix]
    if imported:
        candidates.append(f"{imported}.{rest}" if rest else imported)
    check = _ROLE_CHECKS.get(role, lambda obj: True)
    for dotted in candidates:
        obj = _find(dotted)
        if obj is None or not check(obj):
            if dotted == candidates[-1] and imported and not imported.startswith(OWN_PACKAGES):
                return dotted  # another project's name, not importable here: still another project's
            continue
        if isinstance(obj, enum.Enum):
            return f"{type(obj).__module__}.{type(obj).__qualname__}.{obj.name}"
        home_module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if inspect.ismodule(obj):
            return obj.__name__
        if isinstance(qualname, str) and isinstance(home_module, str) and "<locals>" not in qualname:
            return f"{home_module}.{qualname}"  # a class, function or method
        kind = type(obj)
        if not isinstance(obj, _PLAIN) and not kind.__module__.startswith(OWN_PACKAGES):
            return f"{kind.__module__}.{kind.__qualname__}"  # an instance of another project's class
        return dotted  # a constant: it has no home of its own
    return None


class CanonicalReferences(SphinxPostTransform):
    """Point every Python reference to an object of this project at the object's own name.

    Docstrings and annotations name objects as the module they are in sees them: a name imported
    from another module (``:class:`CheckpointManager``` in ``policies.py``), a name a module
    re-exports (``outcome.OutcomeClass``, defined in ``classification``), an Airflow class the
    provider imports through ``compat``. Sphinx looks only in the current module and, for
    annotations, by suffix, which finds the wrong one of two like-named classes. This resolves the
    name where it was written, before Sphinx's own resolution runs; a name of another project is
    left to the configuration's ``nitpick_ignore_regex``.
    """

    default_priority = 5  # before sphinx.transforms.post_transforms.ReferencesResolver (10)

    def run(self, **kwargs) -> None:
        domain = self.env.get_domain("py")
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("refdomain") != "py":
                continue
            target = node["reftarget"].lstrip(".~")
            home = home_of(target, node.get("py:module") or "", node.get("py:class") or "", node["reftype"])
            if home is None:
                continue
            if home in domain.objects:
                if domain.objects[home].objtype in (domain.objtypes_for_role(node["reftype"]) or ()):
                    node["reftarget"], node["refspecific"] = home, False
            elif not home.startswith(OWN_PACKAGES):
                node["reftarget"], node["refspecific"] = home, False  # nitpick_ignore_regex decides


def resolve_by_suffix(app, env, node, contnode):
    """Last resort for a reference Sphinx could not resolve: the one object of this project, of a
    kind the role names, whose dotted name ends with the target (or the one in the referring
    module's package). Anything else stays unresolved, and ``-n`` reports it."""
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    target, module = node["reftarget"].lstrip(".~"), node.get("py:module") or ""
    kinds = set(domain.objtypes_for_role(node["reftype"]) or ())
    matches = sorted(name for name, entry in domain.objects.items()
                     if name.startswith(OWN_PACKAGES) and name.endswith("." + target) and entry.objtype in kinds)
    if len(matches) > 1:
        package = module.rsplit(".", 1)[0] + "."
        matches = [name for name in matches if name.startswith(package)]
    if len(matches) != 1:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], matches[0], node, contnode)


def setup(app):
    """Register the directive, the reference transform and the resolver."""
    app.add_directive("api-modules", ApiModules)
    app.add_post_transform(CanonicalReferences)
    app.connect("missing-reference", resolve_by_suffix)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
