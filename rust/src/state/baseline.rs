//! The yardstick for heal throughput: plain TCP over loopback, as fast as this
//! machine moves bytes between two sockets — blocking threads, one per connection end,
//! no framing, no checksum — from distinct source memory into distinct destination
//! memory, as a heal does. Benchmarks report a heal's speed as a share of this.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Seconds to move `total_bytes` over `connections` loopback connections at once.
pub fn raw_tcp_seconds(total_bytes: usize, connections: usize) -> io::Result<f64> {
    if connections == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "connections must be 1 or more",
        ));
    }
    let per = total_bytes.div_ceil(connections).max(1);
    // Touched up front, so page faults are not timed (a training process's tensors
    // exist before a heal too).
    let source = vec![0x5Au8; per * connections];
    let mut dest = vec![0xA5u8; per * connections];
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut senders = Vec::with_capacity(connections);
    let mut receivers = Vec::with_capacity(connections);
    for _ in 0..connections {
        senders.push(TcpStream::connect(addr)?);
        receivers.push(listener.accept()?.0);
    }
    let started = Instant::now();
    std::thread::scope(|s| -> io::Result<()> {
        let mut ends = Vec::with_capacity(2 * connections);
        for (mut stream, bytes) in senders.into_iter().zip(source.chunks(per)) {
            ends.push(s.spawn(move || stream.write_all(bytes)));
        }
        for (mut stream, bytes) in receivers.into_iter().zip(dest.chunks_mut(per)) {
            ends.push(s.spawn(move || stream.read_exact(bytes)));
        }
        for end in ends {
            end.join()
                .map_err(|_| io::Error::other("a transfer thread panicked"))??;
        }
        Ok(())
    })?;
    let seconds = started.elapsed().as_secs_f64();
    if dest != source {
        return Err(io::Error::other("raw TCP baseline delivered wrong bytes"));
    }
    Ok(seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_every_byte() {
        let seconds = raw_tcp_seconds(3 << 20, 3).unwrap();
        assert!(seconds > 0.0);
    }
}
