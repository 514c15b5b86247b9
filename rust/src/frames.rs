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

use crate::proto::{self, lighthouse_event::Event};

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

/// A quorum (or quorum update) this large or larger in an answer is not copied into a
/// stream's buffer: see `encode_sharing`.
pub const SHARED: usize = 64 << 10;

/// Appends `event` to `out` as one frame, as `encode` does, but for a quorum or quorum
/// update of `SHARED` bytes or more in an answer: the frame then ends with those
/// bytes, returned to be written after `out` from where they lie. One quorum goes to
/// every member of a round, and a whole one of 10,000 members is a megabyte: copied
/// into each stream's buffer first, that was 10 GB of copies (and 10,000 buffers of
/// a megabyte) for a first round. The frame decodes to the same message; the shared
/// field comes last in it, where protobuf allows any order.
pub fn encode_sharing(event: &proto::LighthouseEvent, out: &mut BytesMut) -> Option<Bytes> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    const QUORUM: u32 = 2;
    const UPDATE: u32 = 5;
    const ANSWER: u32 = 3;
    let Some(Event::Answer(answer)) = &event.event else {
        encode(event, out);
        return None;
    };
    let whole = answer.quorum.len() >= SHARED;
    if !whole && answer.update.len() < SHARED {
        encode(event, out);
        return None;
    }
    let mut rest = answer.clone();
    let (tag, shared) = if whole {
        (QUORUM, std::mem::take(&mut rest.quorum))
    } else {
        (UPDATE, std::mem::take(&mut rest.update))
    };
    let shared_len = shared.len() as u64;
    let answer_len =
        rest.encoded_len() + key_len(tag) + encoded_len_varint(shared_len) + shared.len();
    let event_len = key_len(ANSWER) + encoded_len_varint(answer_len as u64) + answer_len;
    out.reserve(LENGTH + event_len - shared.len());
    out.put_u32(event_len as u32);
    encode_key(ANSWER, WireType::LengthDelimited, out);
    encode_varint(answer_len as u64, out);
    rest.encode_raw(out);
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(shared_len, out);
    Some(shared)
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

    fn answer(quorum: usize, update: usize, message: &str) -> proto::LighthouseEvent {
        let filled = |n: usize| Bytes::from((0..n).map(|i| i as u8).collect::<Vec<_>>());
        proto::LighthouseEvent {
            event: Some(Event::Answer(proto::QuorumAnswer {
                ask_id: (quorum + update) as u64,
                quorum: filled(quorum),
                code: 0,
                message: message.into(),
                update: filled(update),
            })),
        }
    }

    #[test]
    fn a_frame_that_shares_its_quorum_reads_as_the_frame_that_copies_it() {
        let sizes = [0, 1, SHARED - 1, SHARED, SHARED + 1, 3 * SHARED];
        let mut events = vec![proto::LighthouseEvent {
            event: Some(Event::Lease(proto::Lease::default())),
        }];
        for quorum in sizes {
            events.push(answer(quorum, 0, ""));
            events.push(answer(0, quorum, "refused"));
            events.push(answer(quorum, 100, "both"));
        }
        let mut copied = BytesMut::new();
        let mut shared = BytesMut::new();
        let mut sent_apart = 0;
        for event in &events {
            encode(event, &mut copied);
            if let Some(bytes) = encode_sharing(event, &mut shared) {
                sent_apart += 1;
                shared.extend_from_slice(&bytes);
            }
        }
        assert_eq!(
            sent_apart, 9,
            "every quorum or update of SHARED bytes or more"
        );
        assert_eq!(shared.len(), copied.len());
        let frames = Frames { max: 1 << 20 };
        for event in &events {
            let frame = frames.next(&mut shared).unwrap().unwrap();
            assert_eq!(&proto::LighthouseEvent::decode(frame).unwrap(), event);
        }
        assert!(shared.is_empty());
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
