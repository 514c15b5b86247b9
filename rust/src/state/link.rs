//! One connection of a healing rank to one source: it asks, and reads the answers —
//! small ones (layout, manifest, refusals) into a buffer, chunks straight into their
//! destination, checking each against its checksum as the bytes arrive.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::plan::Chunk;
use super::wire::{
    Checksum, Request, RequestKind, ResponseHeader, Status, CHECKSUM_LEN, MAX_TOKEN_LEN,
    RESPONSE_HEADER_LEN,
};
use crate::auth::JobToken;
use crate::{sockopt, Error};

/// Most bytes read and checksummed per step: the checksum pass finds them still in
/// cache. A read returns what has arrived; the link asks the kernel not to wake it
/// before a whole piece is there (see `Link::wake_at`).
const PIECE: usize = 1 << 20;
/// Layout, manifest and refusal answers larger than this are refused unread.
const MAX_SMALL_ANSWER: u64 = 256 << 20;
/// First and longest pause between asks to a source that has not published yet.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
pub(super) const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// What every request of one heal carries.
#[derive(Clone)]
pub(super) struct Ask {
    step: i64,
    quorum_id: u64,
    token: Vec<u8>,
    stall: Duration,
}

impl Ask {
    pub(super) fn new(
        step: i64,
        quorum_id: u64,
        token: &JobToken,
        stall: Duration,
    ) -> Result<Self, Error> {
        let token = token.header_value().unwrap_or_default().into_bytes();
        if token.len() > MAX_TOKEN_LEN {
            return Err(Error::invalid(format!(
                "the job token is {} bytes long; at most {} are allowed",
                token.len(),
                MAX_TOKEN_LEN
            )));
        }
        Ok(Ask {
            step,
            quorum_id,
            token,
            stall,
        })
    }

    fn request(&self, kind: RequestKind, chunk: Chunk) -> Vec<u8> {
        Request {
            kind,
            step: self.step,
            quorum_id: self.quorum_id,
            region: chunk.region,
            offset: chunk.offset,
            len: chunk.len,
            token: self.token.clone(),
        }
        .encode()
        .expect("token length checked in Ask::new")
    }
}

/// What a healing rank makes of a source's answer that is not the data.
enum Verdict {
    /// The source has not published the step yet: ask again later.
    NotYet(String),
    Refused(Error),
}

/// Decides what a refusal means. A source behind the requested (quorum, step) may
/// still get there; one ahead of it, or one that refuses the token, never will.
fn verdict(address: &str, asked: &Ask, header: &ResponseHeader, payload: &[u8]) -> Verdict {
    let said = String::from_utf8_lossy(payload);
    match header.status {
        Status::Ok => unreachable!("not a refusal"),
        Status::Unauthorized => Verdict::Refused(Error::refused(format!(
            "state server {address} refused this rank: {said}"
        ))),
        Status::BadRequest => Verdict::Refused(Error::invalid(format!(
            "state server {address} refused the request: {said}"
        ))),
        Status::NotPublished => Verdict::NotYet(format!(
            "{address} publishes nothing yet (waiting for step {} of quorum {})",
            asked.step, asked.quorum_id
        )),
        Status::OtherWindow => {
            let served = (header.quorum_id, header.step);
            if served < (asked.quorum_id, asked.step) {
                Verdict::NotYet(format!(
                    "{address} still serves step {} of quorum {} (waiting for step {} of \
                     quorum {})",
                    header.step, header.quorum_id, asked.step, asked.quorum_id
                ))
            } else {
                Verdict::Refused(Error::refused(format!(
                    "state server {address} serves step {} of quorum {}, not step {} of quorum \
                     {}: it serves only members of its current quorum; heal with the quorum id \
                     and max_step of the latest quorum",
                    header.step, header.quorum_id, asked.step, asked.quorum_id
                )))
            }
        }
    }
}

/// One connection to one source.
pub(super) struct Link {
    stream: TcpStream,
    address: String,
    ask: Ask,
    /// The socket's receive low-water mark now; None once the kernel refused one.
    lowat: Option<usize>,
}

impl Link {
    pub(super) async fn connect(
        address: &str,
        ask: &Ask,
        deadline: Instant,
    ) -> Result<Link, Error> {
        let limit = ask
            .stall
            .min(deadline.saturating_duration_since(Instant::now()));
        let stream = match tokio::time::timeout(limit, TcpStream::connect(address)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                return Err(Error::connection(format!(
                    "cannot connect to state server {address}: {e}; check that the peer runs and \
                     advertises an address this rank can reach"
                )))
            }
            Err(_) => {
                return Err(Error::timeout(format!(
                    "no connection to state server {address} within {limit:?}"
                )))
            }
        };
        // Requests are small and each waits for its answer: send them at once.
        let _ = stream.set_nodelay(true);
        Ok(Link {
            stream,
            address: address.to_string(),
            ask: ask.clone(),
            lowat: Some(1),
        })
    }

    /// Asks the kernel to report the socket readable only once `bytes` have arrived
    /// (SO_RCVLOWAT). Left at one byte, every segment that lands wakes the reader for
    /// a read of what little is there; a 1 GiB heal read in ~170 KB bites, and each
    /// read's window update is one more packet for the sender to take. Woken per
    /// piece instead, the receiving end of a loopback heal spent a quarter less CPU.
    /// The mark is never above what the link still waits for, so the last bytes of an
    /// answer still wake it; the kernel wakes a reader whose buffer is full whatever
    /// the mark; and a link too slow to fill a piece gives its mark up (`read_some`).
    fn wake_at(&mut self, bytes: usize) {
        let Some(now) = self.lowat else { return };
        let bytes = bytes.clamp(1, PIECE);
        if bytes == now {
            return;
        }
        self.lowat = match set_receive_low_water(&self.stream, bytes) {
            Ok(()) => Some(bytes),
            // Only ever a hint: give up on it, and make sure none is left behind.
            Err(_) => {
                let _ = set_receive_low_water(&self.stream, 1);
                None
            }
        };
    }

    pub(super) fn lost(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::connection(format!("state server {} failed {what}: {e}", self.address))
    }

    async fn send(&mut self, request: &[u8]) -> Result<(), Error> {
        match tokio::time::timeout(self.ask.stall, self.stream.write_all(request)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.lost("while asking", e)),
            Err(_) => Err(self.stalled()),
        }
    }

    fn stalled(&self) -> Error {
        Error::connection(format!(
            "state server {} sent nothing for {:?}; treating it as failed",
            self.address, self.ask.stall
        ))
    }

    /// One read, bounded by the stall timeout. A slow source (a capped link, a paced
    /// server) may not fill a piece within it while it sends all along: after half
    /// the timeout with nothing read, the link gives up its mark for good and waits
    /// the other half for any byte, so only a source silent for the whole timeout
    /// is taken for failed.
    async fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, Error> {
        let mut wait = self.ask.stall;
        if self.lowat.is_some_and(|mark| mark > 1) {
            wait = self.ask.stall / 2;
            if let Ok(read) = tokio::time::timeout(wait, self.stream.read(buf)).await {
                return read.map_err(|e| self.lost("mid-answer", e));
            }
            // Lowering the mark below what is queued makes the socket readable.
            let _ = set_receive_low_water(&self.stream, 1);
            self.lowat = None;
            wait = self.ask.stall - wait;
        }
        match tokio::time::timeout(wait, self.stream.read(buf)).await {
            Ok(read) => read.map_err(|e| self.lost("mid-answer", e)),
            Err(_) => Err(self.stalled()),
        }
    }

    /// Fills `buf`, each read bounded by the stall timeout; feeds `crc` what arrived.
    async fn read_into(
        &mut self,
        buf: &mut [u8],
        mut crc: Option<&mut Checksum>,
    ) -> Result<(), Error> {
        let mut filled = 0;
        while filled < buf.len() {
            let end = buf.len().min(filled + PIECE);
            self.wake_at(end - filled);
            let n = match self.read_some(&mut buf[filled..end]).await? {
                0 => return Err(self.lost("mid-answer", "connection closed")),
                n => n,
            };
            if let Some(crc) = crc.as_deref_mut() {
                crc.update(&buf[filled..filled + n]);
            }
            filled += n;
        }
        Ok(())
    }

    async fn read_header(&mut self) -> Result<ResponseHeader, Error> {
        let mut header = [0u8; RESPONSE_HEADER_LEN];
        self.read_into(&mut header, None).await?;
        ResponseHeader::decode(&header).map_err(|e| self.lost("with a bad answer", e))
    }

    /// Reads a small payload and its checksum.
    async fn read_small(&mut self, header: &ResponseHeader) -> Result<Vec<u8>, Error> {
        if header.payload_len > MAX_SMALL_ANSWER {
            return Err(self.lost(
                "with a bad answer",
                format!(
                    "{} bytes announced, at most {MAX_SMALL_ANSWER} allowed",
                    header.payload_len
                ),
            ));
        }
        let mut payload = vec![0u8; header.payload_len as usize];
        let mut crc = Checksum::new();
        self.read_into(&mut payload, Some(&mut crc)).await?;
        if !self.read_trailer(crc).await? {
            return Err(self.lost("with a bad answer", "payload checksum mismatch"));
        }
        Ok(payload)
    }

    /// Reads the checksum that ends an answer; true if it matches.
    async fn read_trailer(&mut self, crc: Checksum) -> Result<bool, Error> {
        let mut trailer = [0u8; CHECKSUM_LEN];
        self.read_into(&mut trailer, None).await?;
        Ok(u32::from_le_bytes(trailer) == crc.finish())
    }

    /// Asks for a layout or the manifest, again and again while the source has not
    /// published the step yet, until the deadline. `waiting` hears why it waits.
    pub(super) async fn ask_until_served(
        &mut self,
        kind: RequestKind,
        deadline: Instant,
        waiting: &(dyn Fn(String) + Sync),
    ) -> Result<Vec<u8>, Error> {
        let request = self.ask.request(
            kind,
            Chunk {
                region: 0,
                offset: 0,
                len: 0,
            },
        );
        let mut backoff = FIRST_BACKOFF;
        loop {
            self.send(&request).await?;
            let header = self.read_header().await?;
            let payload = self.read_small(&header).await?;
            if header.status == Status::Ok {
                return Ok(payload);
            }
            match verdict(&self.address, &self.ask, &header, &payload) {
                Verdict::Refused(e) => return Err(e),
                Verdict::NotYet(why) => {
                    if Instant::now() + backoff >= deadline {
                        return Err(Error::timeout(format!("gave up: {why}")));
                    }
                    waiting(why);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    pub(super) async fn ask_chunk(&mut self, chunk: Chunk) -> Result<(), Error> {
        let request = self.ask.request(RequestKind::Chunk, chunk);
        self.send(&request).await
    }

    /// Receives the answer to the oldest chunk asked for, into `dest`; Ok(false) if it
    /// arrived damaged (the stream is still in step, so the connection can go on).
    pub(super) async fn receive_chunk(
        &mut self,
        chunk: Chunk,
        dest: &mut [u8],
    ) -> Result<bool, Error> {
        let header = self.read_header().await?;
        if header.status != Status::Ok {
            let payload = self.read_small(&header).await?;
            return Err(match verdict(&self.address, &self.ask, &header, &payload) {
                Verdict::Refused(e) => e,
                Verdict::NotYet(why) => {
                    Error::connection(format!("stopped serving mid-heal: {why}"))
                }
            });
        }
        if header.payload_len != chunk.len {
            return Err(self.lost(
                "with a bad answer",
                format!("{} bytes for a chunk of {}", header.payload_len, chunk.len),
            ));
        }
        let mut crc = Checksum::new();
        self.read_into(dest, Some(&mut crc)).await?;
        self.read_trailer(crc).await
    }
}

/// Sets SO_RCVLOWAT. Lowering it below what is queued makes the kernel report the
/// socket readable, so a read waiting on the old mark is woken.
fn set_receive_low_water(stream: &TcpStream, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    sockopt::set_int(
        stream.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_RCVLOWAT,
        bytes,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn ask(step: i64, quorum_id: u64) -> Ask {
        Ask::new(
            step,
            quorum_id,
            &JobToken::default(),
            Duration::from_secs(1),
        )
        .unwrap()
    }

    fn other(step: i64, quorum_id: u64) -> ResponseHeader {
        ResponseHeader {
            status: Status::OtherWindow,
            payload_len: 0,
            step,
            quorum_id,
        }
    }

    #[test]
    fn a_source_behind_is_waited_for_and_one_ahead_refuses() {
        let asked = ask(10, 5);
        for behind in [other(9, 5), other(11, 4)] {
            assert!(matches!(
                verdict("a", &asked, &behind, b""),
                Verdict::NotYet(_)
            ));
        }
        for ahead in [other(11, 5), other(10, 6), other(3, 6)] {
            match verdict("a", &asked, &ahead, b"") {
                Verdict::Refused(e) => assert_eq!(e.kind(), ErrorKind::Permission),
                Verdict::NotYet(why) => panic!("waited for a source ahead: {why}"),
            }
        }
    }
}
