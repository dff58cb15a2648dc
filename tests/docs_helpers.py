"""What the documentation tests share: the public names the API reference
must document (tests/test_docs.py checks the built site, and
tests/test_api_markdown.py the Markdown pages)."""
import importlib
import types

# The modules whose `__all__` is public API (API.md): the package, its
# subpackages named in its `__all__` (nn, dist), the launcher, the GluonCV
# drop-ins, and the AMP check the guide tells users to call.
PUBLIC_MODULES = ('gluon_parallel', 'gluon_parallel.launch', 'gluon_parallel.gluoncv',
                  'gluon_parallel.loss_scaling')


def public_names(modules=PUBLIC_MODULES):
    """Full names of every public object: each module, and each name of its
    `__all__` (a name that is itself a module is followed into its own
    `__all__`)."""
    names, todo, seen = [], list(modules), set()
    while todo:
        modname = todo.pop(0)
        if modname in seen:
            continue
        seen.add(modname)
        names.append(modname)
        module = importlib.import_module(modname)
        for name in module.__all__:
            full = f'{modname}.{name}'
            if isinstance(getattr(module, name), types.ModuleType):
                todo.append(full)
            else:
                names.append(full)
    return names
