//! Frames of a heartbeat stream over a plain TCP connection (`proto::BeatOpen`): the
//! preface that tells such a connection from HTTP on the lighthouse's one port, and
//! length-prefixed messages. Pure: bytes in, messages out; the I/O is
//! `lighthouse::wire`.
//!
//! Why not HTTP/2: a lighthouse of 10,000 groups at 10 beats a second spent half of a
//! beat's 22 µs in the per-stream machinery of HTTP/2 (stream state, frame headers,
//! flow control, wakeups between its connection and stream tasks), for messages of a
//! few dozen bytes on a stream that lives as long as the group. A frame here is its
//! length and its bytes.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;

/// The first bytes of a framed connection. Its first byte, 0xFF, starts no HTTP/1
/// request (a method's letter) and no HTTP/2 connection ("PRI * HTTP/2.0"), so one
/// byte tells the two apart; the rest names the framing and its version.
pub const PREFACE: &[u8; 8] = b"\xffPHXBT1\n";

/// Bytes of a frame's length.
const LENGTH: usize = 4;

/// Whether a connection whose first byte is `first` speaks frames, not HTTP.
///
/// ```
/// use phalanx::frames::{speaks_frames, PREFACE};
/// assert!(speaks_frames(PREFACE[0]));
/// assert!(!speaks_frames(b'P') && !speaks_frames(b'G'));
/// ```
pub fn speaks_frames(first: u8) -> bool {
    first == PREFACE[0]
}

/// Appends `message` to `out` as one frame.
pub fn encode(message: &impl Message, out: &mut BytesMut) {
    let len = message.encoded_len();
    out.reserve(LENGTH + len);
    out.put_u32(len as u32);
    message
        .encode(out)
        .expect("the buffer was reserved for the message");
}

/// A frame the reader refuses: the connection it came on is closed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("the connection did not open with phalanx's heartbeat preface")]
    Preface,
    #[error("a frame of {len} bytes, over the {max} accepted")]
    TooLarge { len: usize, max: usize },
}

/// Cuts frames out of the bytes read so far.
#[derive(Clone, Copy, Debug)]
pub struct Frames {
    /// Largest frame accepted: a length above it is refused before its bytes come.
    pub max: usize,
}

impl Frames {
    /// Takes the preface off the front of `read` once all of it is there: Ok(false)
    /// while it is not, an error as soon as a byte differs.
    pub fn preface(read: &mut BytesMut) -> Result<bool, FrameError> {
        let n = read.len().min(PREFACE.len());
        if read[..n] != PREFACE[..n] {
            return Err(FrameError::Preface);
        }
        if n < PREFACE.len() {
            return Ok(false);
        }
        read.advance(PREFACE.len());
        Ok(true)
    }

    /// The next whole frame's message bytes, taken off the front of `read`; None
    /// until all of it has been read.
    pub fn next(&self, read: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        if read.len() < LENGTH {
            return Ok(None);
        }
        let len = u32::from_be_bytes(read[..LENGTH].try_into().expect("4 bytes")) as usize;
        if len > self.max {
            return Err(FrameError::TooLarge { len, max: self.max });
        }
        if read.len() < LENGTH + len {
            read.reserve(LENGTH + len - read.len());
            return Ok(None);
        }
        read.advance(LENGTH);
        Ok(Some(read.split_to(len).freeze()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;

    fn beat(seq: u64) -> proto::Beat {
        proto::Beat {
            seq,
            step: seq as i64 * 3,
            replica_id: "g".repeat(seq as usize % 7),
            ..Default::default()
        }
    }

    #[test]
    fn frames_come_out_whole_however_the_bytes_are_cut() {
        let mut wire = BytesMut::from(&PREFACE[..]);
        for seq in 0..20 {
            encode(&beat(seq), &mut wire);
        }
        let frames = Frames { max: 1024 };
        for cut in [1, 2, 3, 5, 8, 13, wire.len()] {
            let mut read = BytesMut::new();
            let (mut opened, mut got) = (false, Vec::new());
            for chunk in wire.chunks(cut) {
                read.extend_from_slice(chunk);
                if !opened {
                    opened = Frames::preface(&mut read).unwrap();
                }
                if opened {
                    while let Some(bytes) = frames.next(&mut read).unwrap() {
                        got.push(proto::Beat::decode(bytes).unwrap());
                    }
                }
            }
            assert_eq!(got, (0..20).map(beat).collect::<Vec<_>>(), "cut {cut}");
            assert!(read.is_empty());
        }
    }

    #[test]
    fn http_and_oversized_frames_are_refused_before_their_bytes_come() {
        for http in [
            &b"PRI * HTTP/2.0\r\n"[..],
            b"GET / HTTP/1.1\r\n",
            b"\xffPHXBT2\n",
        ] {
            let mut read = BytesMut::from(http);
            assert_eq!(Frames::preface(&mut read), Err(FrameError::Preface));
        }
        // A partial preface waits for the rest.
        let mut read = BytesMut::from(&PREFACE[..3]);
        assert_eq!(Frames::preface(&mut read), Ok(false));

        let mut read = BytesMut::new();
        read.put_u32(1 << 30);
        let refused = Frames { max: 64 * 1024 }.next(&mut read);
        assert_eq!(
            refused,
            Err(FrameError::TooLarge {
                len: 1 << 30,
                max: 64 * 1024
            })
        );
        assert!(read.capacity() < 1 << 20, "nothing reserved for it");
    }
}
