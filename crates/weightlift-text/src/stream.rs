//! [`StreamDecoder`]: ids in one at a time, text out without splitting a UTF-8 character.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Decodes ids one at a time. Byte-level tokens and SentencePiece `<0xNN>` tokens can carry
/// part of a character; the decoder holds such bytes back until the character is complete, so
/// every piece it returns is whole UTF-8, and the pieces (with [`StreamDecoder::finish`]) join to
/// exactly [`Tokenizer::decode`] of all the ids.
///
/// The decoder holds only its state, not the tokenizer, so a generation can own both side by
/// side; every [`StreamDecoder::push`] takes the tokenizer that made it.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    skip_special: bool,
    pending: Vec<u8>,
    n_ids: usize,
    /// `decode` drops one leading space when the first id is BOS; armed until the first byte.
    strip_space: bool,
    emitted_any: bool,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> StreamDecoder {
        StreamDecoder {
            skip_special,
            pending: Vec::new(),
            n_ids: 0,
            strip_space: false,
            emitted_any: false,
        }
    }

    /// Feed one id (with the tokenizer the decoder was made for); returns the text that is now complete (often empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        if self.n_ids == 0 {
            self.strip_space = tok.bos_id() == Some(id);
        }
        self.n_ids += 1;
        let start = self.pending.len();
        tok.push_piece(id, !self.skip_special, &mut self.pending)?;
        if !self.emitted_any && self.pending.len() > start {
            self.emitted_any = true;
            if self.strip_space && self.pending.first() == Some(&b' ') {
                self.pending.remove(0);
            }
        }
        Ok(self.take(false))
    }

    /// The bytes still held back (an incomplete character at the end), as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.take(true)
    }

    /// Everything complete in `pending`; invalid sequences become U+FFFD as
    /// `String::from_utf8_lossy` makes them, and an incomplete tail waits unless `all`.
    fn take(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut used = 0;
        loop {
            let rest = &self.pending[used..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    used = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&rest[..valid]) {
                        out.push_str(s);
                    }
                    used += valid;
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            used += n;
                        }
                        None if all => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            used = self.pending.len();
                            break;
                        }
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..used);
        out
    }
}
