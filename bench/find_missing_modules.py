"""List every module a test module's imports need that this machine lacks (one pass, no install).

Each missing module is replaced by an empty stand-in and the import retried, so a single run names
them all instead of failing on the first. Used to plan which wheels must travel to a bare GPU machine.
"""
import importlib
import sys
import types

missing: list[str] = []
target = sys.argv[1] if len(sys.argv) > 1 else "tests.sglang_harness"
for _ in range(100):
    try:
        importlib.import_module(target)
        break
    except ModuleNotFoundError as exc:
        name = exc.name or str(exc)
        missing.append(name)
        sys.modules[name] = types.ModuleType(name)
        for mod in [m for m in sys.modules if m.startswith(("sglang", "tests."))]:
            del sys.modules[mod]
    except Exception as exc:  # past the missing modules: report what failed next
        print(f"import of {target} failed after stand-ins: {type(exc).__name__}: {exc}")
        break
print("missing modules:", missing or "none")
