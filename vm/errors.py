"""Errors a user of dynvm can cause, one class per kind of mistake.

Every message names the thing that is wrong (input, dimension, section, instruction),
what was expected and what was found, so that a caller can act on it without reading
dynvm's source.
"""


class DynvmError(Exception):
    """Base of every error dynvm raises on purpose."""


class ShapeError(DynvmError, ValueError):
    """An input does not match the program's declared signature (rank, dtype, device or a
    dim outside its declared range)."""


class VerifyError(DynvmError):
    """A program is malformed: undefined register, bad jump target, wrong operand kind."""


class AssembleError(DynvmError):
    """The text form of a program could not be parsed."""


class DvmFormatError(DynvmError):
    """A .dvm file is not a dvm file, truncated, corrupt, or of another format version."""


class UnsupportedOpError(DynvmError):
    """The frontend met an operator the bytecode has no instruction for."""


class UnregisteredOpError(DynvmError):
    """A program calls a custom op (Note [Custom ops] in dynvm.vm.ops_custom) that this
    process has not registered, or registered with another schema."""


class InputError(DynvmError, TypeError):
    """A call passed the wrong number or kind of inputs (to a program, or to a dynvm
    function: bytes where bytes are read, for instance)."""


class ConfigError(DynvmError, ValueError):
    """A setting dynvm cannot use: a field of a config dataclass (JitConfig,
    ServingLimits, ...), a budget, a limit or a target; the message names the setting,
    what it must be and what it was."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (a ConfigError that `except TypeError` also catches)."""


class SaveError(DynvmError, ValueError):
    """A program cannot be written as a .dvm file (a constant of a dtype the format cannot
    store, two constants of one name); the message names the program and the constant."""


class ExecutionError(DynvmError, RuntimeError):
    """An instruction failed at run time (for example an index out of range in the
    data); the message names the instruction and carries the kernel's own message."""


class CallBudgetError(DynvmError, TimeoutError):
    """A call ran past its budget of time or loop iterations (Note [Call budget] in
    dynvm.vm.budget): a loop that does not end. `pc` is the loop's back edge."""

    def __init__(self, message: str, pc: int = -1, iterations: int = 0,
                 seconds: float = 0.0) -> None:
        super().__init__(message)
        self.pc, self.iterations, self.seconds = pc, iterations, seconds

    def __reduce__(self):
        return type(self), (str(self), self.pc, self.iterations, self.seconds)


# --- .dvm file errors: what exactly is wrong with the bytes (raised by dynvm.vm.dvm_file).
# Each keeps its facts as attributes; __reduce__ lets them cross process boundaries (Ray).


class NotDvmFileError(DvmFormatError):
    """The bytes do not start with the .dvm magic."""

    def __init__(self, first_bytes: bytes, magic: bytes, hint: str = "") -> None:
        self.first_bytes, self.magic, self.hint = bytes(first_bytes), bytes(magic), hint
        message = (f"not a .dvm file: it starts with {self.first_bytes!r}, a .dvm file starts "
                   f"with {self.magic!r}")
        super().__init__(f"{message} ({hint})" if hint else message)

    def __reduce__(self):
        return type(self), (self.first_bytes, self.magic, self.hint)


class TruncatedFileError(DvmFormatError):
    """The file ends before the end its header and section table promise."""

    def __init__(self, expected: int, present: int, at_least: bool = False) -> None:
        self.expected, self.present, self.at_least = expected, present, at_least
        bound = "at least " if at_least else ""
        super().__init__(f"truncated .dvm file: expected {bound}{expected} bytes, "
                         f"{present} present")

    def __reduce__(self):
        return type(self), (self.expected, self.present, self.at_least)


class ChecksumError(DvmFormatError):
    """The sha256 stored at the end of a .dvm file does not match its contents."""

    def __init__(self, stored: str, computed: str, detail: str = "") -> None:
        self.stored, self.computed, self.detail = stored, computed, detail
        message = f"corrupt .dvm file: stored sha256 {stored}, contents hash to {computed}"
        super().__init__(f"{message} ({detail})" if detail else message)

    def __reduce__(self):
        return type(self), (self.stored, self.computed, self.detail)


class VersionError(DvmFormatError):
    """The file, or one of its sections, has a version this dynvm does not read.
    `section` is the section's name, or "file" for the format version."""

    def __init__(self, section: str, expected: int, actual: int) -> None:
        self.section, self.expected, self.actual = section, expected, actual
        what = "file format" if section == "file" else f"section {section}"
        super().__init__(f"{what} has version {actual}, this dynvm reads version {expected}")

    def __reduce__(self):
        return type(self), (self.section, self.expected, self.actual)


class DvmSignatureError(DvmFormatError):
    """A .dvm file that must be signed is unsigned, or its signature does not match
    (Note [Signed programs] in dynvm.vm.dvm_signature). `path` names the file."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"untrusted .dvm file {path!r}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)


class CorruptSectionError(DvmFormatError):
    """A section of a .dvm file (or its section table) is malformed or disagrees with
    another section. `section` names it ("section table" for the table itself)."""

    def __init__(self, section: str, problem: str) -> None:
        self.section, self.problem = section, problem
        super().__init__(f"corrupt .dvm file: {section}: {problem}")

    def __reduce__(self):
        return type(self), (self.section, self.problem)
