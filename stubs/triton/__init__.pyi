# Minimal typed stubs for the parts of triton that kda-ops uses (triton ships no py.typed).
# Kernel bodies are not type-checked in depth: `triton.language` is all `Any`. Launchers are: `kernel[grid](...)`.
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, overload

from triton import language as language
from triton import testing as testing

__version__: str

_F = TypeVar("_F", bound=Callable[..., Any])
_K = TypeVar("_K")

class KernelInterface(Generic[_F]):
    def __getitem__(self, grid: Any) -> Callable[..., Any]: ...

class JITFunction(KernelInterface[_F]):
    fn: _F
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class Config:
    kwargs: dict[str, Any]
    num_warps: int
    num_stages: int
    num_ctas: int
    def __init__(
        self,
        kwargs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 3,
        num_ctas: int = 1,
        maxnreg: int | None = None,
        pre_hook: Callable[..., Any] | None = None,
        ir_override: Any = None,
    ) -> None: ...

@overload
def jit(fn: _F) -> JITFunction[_F]: ...
@overload
def jit(
    fn: None = None,
    *,
    version: Any = None,
    repr: Callable[..., Any] | None = None,
    launch_metadata: Callable[..., Any] | None = None,
    do_not_specialize: Iterable[int | str] | None = None,
    do_not_specialize_on_alignment: Iterable[int | str] | None = None,
    debug: bool | None = None,
    noinline: bool | None = None,
) -> Callable[[_F], JITFunction[_F]]: ...
def autotune(
    configs: list[Config],
    key: list[str],
    prune_configs_by: dict[str, Any] | None = None,
    reset_to_zero: list[str] | None = None,
    restore_value: list[str] | None = None,
    pre_hook: Callable[..., Any] | None = None,
    post_hook: Callable[..., Any] | None = None,
    warmup: int | None = None,
    rep: int | None = None,
    use_cuda_graph: bool = False,
    do_bench: Callable[..., Any] | None = None,
    cache_results: bool = False,
) -> Callable[[_K], _K]: ...
def heuristics(values: dict[str, Callable[[dict[str, Any]], Any]]) -> Callable[[_K], _K]: ...
def cdiv(x: int, y: int) -> int: ...
def next_power_of_2(n: int) -> int: ...

# Anything else (triton.runtime, triton.knobs, ...) is Any: kernel code may reach for it without a stub edit.
def __getattr__(name: str) -> Any: ...
