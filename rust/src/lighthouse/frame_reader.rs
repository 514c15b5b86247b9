//! Messages in frames (`crate::frames`), read from one end of a connection as they
//! come: the lighthouse's end of a framed heartbeat stream reads its `BeatOpen` and
//! beats with it (`heartbeat::BeatReader`), the group's end its events (`wire`).

use std::io;

use bytes::BytesMut;
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt};
use tonic::Status;

use crate::frames::{FrameError, Frames};

/// Reads are at least this large: a read takes every beat that arrived meanwhile.
pub(super) const READ_AHEAD: usize = 8 * 1024;

/// Messages in frames from one end of a connection.
pub(super) struct FrameReader<R> {
    io: R,
    read: BytesMut,
    frames: Frames,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(super) fn new(io: R, max: usize) -> Self {
        FrameReader {
            io,
            read: BytesMut::with_capacity(READ_AHEAD),
            frames: Frames { max },
        }
    }

    /// Reads more; false at the end of the connection.
    async fn fill(&mut self) -> Result<bool, Status> {
        if self.read.capacity() - self.read.len() < READ_AHEAD / 2 {
            self.read.reserve(READ_AHEAD);
        }
        match self.io.read_buf(&mut self.read).await {
            Ok(n) => Ok(n > 0),
            Err(e) => Err(lost(&e)),
        }
    }

    pub(super) async fn preface(&mut self) -> Result<(), Status> {
        while !Frames::preface(&mut self.read).map_err(refused)? {
            if !self.fill().await? {
                return Err(Status::invalid_argument(
                    "the connection closed in its preface",
                ));
            }
        }
        Ok(())
    }

    /// The next message; None at the end of the connection between frames.
    pub(super) async fn message<M: Message + Default>(&mut self) -> Result<Option<M>, Status> {
        loop {
            if let Some(bytes) = self.frames.next(&mut self.read).map_err(refused)? {
                return M::decode(bytes)
                    .map(Some)
                    .map_err(|e| Status::invalid_argument(format!("a malformed frame: {e}")));
            }
            if !self.fill().await? {
                if self.read.is_empty() {
                    return Ok(None);
                }
                return Err(Status::unavailable("the connection closed inside a frame"));
            }
        }
    }
}

fn refused(e: FrameError) -> Status {
    Status::invalid_argument(e.to_string())
}

fn lost(e: &io::Error) -> Status {
    Status::unavailable(format!("the heartbeat connection broke: {e}"))
}
