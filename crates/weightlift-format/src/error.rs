//! The one error type of this crate. Every message names the file, the key or tensor, what was
//! expected and what was found, and the likely cause.

use std::path::PathBuf;

/// A checkpoint that cannot be read, or a request it cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The operating system refused an open, stat or map.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is structurally invalid. `what` names the key, tensor or field; `expected` and
    /// `got` say what was wrong; `hint` gives the likely cause.
    #[error("{path}: {what}: expected {expected}, got {got}; {hint}")]
    Invalid {
        path: PathBuf,
        what: String,
        expected: String,
        got: String,
        hint: &'static str,
    },

    /// A valid file that uses something this build does not support (a GGUF version, a type,
    /// an architecture).
    #[error("{path}: {what} is not supported: {detail}")]
    Unsupported {
        path: PathBuf,
        what: String,
        detail: String,
    },

    /// `check_tensors` found a NaN or an infinity.
    #[error(
        "{path}: tensor '{tensor}' has a non-finite value ({kind}) at element {index}; the file is corrupted or the model diverged"
    )]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: u64,
        kind: &'static str,
    },

    /// A name that the checkpoint does not hold.
    #[error("no tensor named '{name}' in {path}")]
    NoSuchTensor { path: PathBuf, name: String },

    /// The architecture (`ModelSpec`) could not be read from the GGUF metadata or the HF
    /// `config.json`. `key` names the metadata or config key.
    #[error("model spec: {key}: {detail}")]
    Spec { key: String, detail: String },

    /// Dequantising one tensor failed; `source` says why.
    #[error("{path}: cannot dequantize tensor '{tensor}': {source}")]
    Dequantize {
        path: PathBuf,
        tensor: String,
        #[source]
        source: Box<FormatError>,
    },

    /// Block data that the reference dequantiser cannot decode: a type it does not support, or
    /// a byte length that is not what the element count requires. Carries no path; callers
    /// that know the tensor wrap it in `Dequantize`.
    #[error("{dtype} data: {detail}")]
    DequantizeBlocks { dtype: crate::DType, detail: String },

    /// A request that does not fit what it names: a row or column range outside a quantised
    /// linear, or an output buffer of the wrong length. `what` names the thing asked for.
    #[error("{what}: expected {expected}, got {got}")]
    Request {
        what: String,
        expected: String,
        got: String,
    },
}

/// Hints reused across readers, so the same cause reads the same way everywhere.
pub mod hint {
    pub const TRUNCATED: &str = "the file is truncated or still downloading";
    pub const CORRUPT: &str = "the file is corrupted or was not written by a GGUF writer";
    pub const CORRUPT_ST: &str = "the file is corrupted or was not written by a safetensors writer";
    pub const HOSTILE: &str = "the file is corrupted or was crafted to exhaust memory";
    pub const BYTE_ORDER: &str = "the file looks big-endian; convert it on a little-endian machine (gguf-py can rewrite the byte order)";
    pub const SHARDS: &str = "the shard set is incomplete or its index does not match the shards";
    pub const ESCAPE: &str =
        "the index points outside the model folder, which is refused for safety";
    pub const NEWER_WRITER: &str = "the file was written by a newer tool than this build knows";
    pub const NOT_GGUF: &str = "the file is not a GGUF file, or is corrupted";
    pub const CORRUPT_HEADER: &str =
        "the header is corrupted, or the file is not a GGUF file this tool can read";
    pub const SPLIT_NAMES: &str = "split GGUF parts must keep the names gguf-split gave them (name-00001-of-00003.gguf) and sit in one folder";
    pub const QUANT_CONFIG: &str = "the quantisation settings or the architecture in config.json do not match the tensors; the config was edited or belongs to another conversion of the model";
    pub const QUANT_TENSORS: &str =
        "the quantised tensors are incomplete or damaged; re-download or re-convert the checkpoint";
    pub const NO_QUANT_CONFIG: &str = "the quantisation settings were not copied with the weights (GPTQ keeps them in config.json's quantization_config or in quantize_config.json, EXL2 in config.json)";
    pub const OLD_GGUF: &str =
        "the file uses an early GGUF layout; re-convert it with a current llama.cpp or gguf-py";
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

/// Bytes from a file as a message shows them: hex, then, when any byte is printable ASCII, the
/// text with `.` for the others (as `hexdump -C` prints it): `50 4b 03 04 ('PK..')`,
/// `47 47 4d 4c ('GGML')`, `00 00 00 00`. Never a Rust escape such as `\u{18}`.
pub(crate) fn show_bytes(bytes: &[u8]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let hex = hex.join(" ");
    if !bytes.iter().any(u8::is_ascii_graphic) {
        return hex;
    }
    let text: String = bytes
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                char::from(b)
            } else {
                '.'
            }
        })
        .collect();
    format!("{hex} ('{text}')")
}

#[cfg(test)]
mod tests {
    use super::show_bytes;

    #[test]
    fn bytes_show_as_hex_and_their_printable_text() {
        assert_eq!(show_bytes(b"GGML"), "47 47 4d 4c ('GGML')");
        assert_eq!(show_bytes(b"PK\x03\x04"), "50 4b 03 04 ('PK..')");
        assert_eq!(
            show_bytes(&[0x18, 0x00, 0xaf, 0x3c]),
            "18 00 af 3c ('...<')"
        );
        assert_eq!(show_bytes(&[0x18, 0x00, 0xaf, 0x80]), "18 00 af 80");
        assert_eq!(show_bytes(b""), "");
        for b in 0..=255u8 {
            assert!(!show_bytes(&[b]).contains("\\u{"), "{b:#04x}");
        }
    }
}
