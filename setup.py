"""Installs ``lightning_protrain.pth`` next to the packages (site-packages), for regular and
editable installs alike: it runs ``_lightning_protrain_pth`` at interpreter start-up, which makes
``Trainer(strategy="protrain")`` work without ``import lightning_protrain``. Everything else is
in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "lightning_protrain.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    """Regular wheels: the .pth file goes to the wheel's root, i.e. site-packages."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib, PTH)), preserve_mode=0)


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: the same wheel, plus the .pth file."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping) -> None:
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH, (HERE / PTH).read_text())


class EditableWheelWithPth(editable_wheel):
    """Editable installs (pip install -e .)."""

    def _select_strategy(self, name, tag, build_lib):
        return _StrategyWithPth(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
