//! A healing rank's side: the manifest from whichever source answers first, then the
//! bytes striped over every source at once, several connections per source, each
//! chunk read from the socket straight into its place in the destination and checked
//! against its checksum as it arrives (while it is still in cache).
//!
//! A damaged chunk is fetched again; a source that fails mid-transfer is dropped and
//! its chunks are fetched from the others. Everything is bounded by one deadline (I6).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::link::{Ask, Link, MAX_BACKOFF};
use super::plan::{chunks, Chunk, StripePlan};
use super::wire::{decode_layout, RequestKind, MAX_CHUNK_LEN};
use crate::auth::JobToken;
use crate::{Error, ErrorKind};

/// Chunk requests kept outstanding per connection.
const PIPELINE: usize = 2;

/// Memory a fetch writes into.
#[derive(Clone, Copy, Debug)]
pub struct DestRegion {
    addr: usize,
    len: usize,
}

impl DestRegion {
    /// # Safety
    /// `len` bytes from `addr` must be writable, and neither read nor written by
    /// anything else, until the `fetch_state` given this region has returned; its
    /// future must be driven to completion, not dropped (run it as its own task and
    /// stop it early through its `cancel` argument), because connection tasks write
    /// into the memory until it returns. `addr` may be anything when `len` is 0.
    pub unsafe fn new(addr: usize, len: usize) -> Self {
        DestRegion { addr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Clone, Debug)]
pub struct FetchOptions {
    pub token: JobToken,
    /// For the whole fetch, waiting for sources to publish included.
    pub timeout: Duration,
    /// Parallel connections to each source: one keeps a source's link busy only
    /// between request round trips; two or more overlap them.
    pub connections_per_source: usize,
    /// Bytes per request: large enough that the request round trip is noise, small
    /// enough that a failed source leaves little to fetch again.
    pub chunk_bytes: u64,
    /// A source that sends nothing for this long is treated as failed (a hung
    /// process keeps its sockets open).
    pub stall_timeout: Duration,
    /// Times one chunk may be handed out before the fetch gives up on it.
    pub max_attempts: u32,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            token: JobToken::default(),
            timeout: Duration::from_secs(60),
            connections_per_source: 2,
            chunk_bytes: 4 << 20,
            stall_timeout: Duration::from_secs(10),
            max_attempts: 5,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchStats {
    pub bytes: u64,
    pub seconds: f64,
    pub chunks: usize,
    /// Chunks fetched again after a checksum mismatch or a failed source.
    pub refetches: u64,
    /// Bytes received intact from each source, in the order given.
    pub per_source: Vec<(String, u64)>,
    /// Sources dropped during the fetch, and why.
    pub failed_sources: Vec<(String, String)>,
}

/// Asks every source for the manifest of `step` in quorum `quorum_id`; returns the
/// first one that arrives intact. A source that has not published that step yet is
/// asked again until the deadline.
pub async fn fetch_manifest(
    sources: &[String],
    step: i64,
    quorum_id: u64,
    token: &JobToken,
    timeout: Duration,
) -> Result<Vec<u8>, Error> {
    check_sources(sources)?;
    let deadline = Instant::now() + timeout;
    let ask = Ask::new(step, quorum_id, token, timeout.min(Duration::from_secs(10)))?;
    let mut asks = JoinSet::new();
    for address in sources {
        let (ask, address) = (ask.clone(), address.clone());
        asks.spawn(async move {
            let mut link = Link::connect(&address, &ask, deadline).await?;
            link.ask_until_served(RequestKind::Manifest, deadline, &|_| {})
                .await
        });
    }
    let mut failures = Vec::new();
    // Each ask ends by the deadline on its own; the margin only guards against a bug.
    while let Ok(Some(joined)) =
        tokio::time::timeout_at(deadline + MAX_BACKOFF, asks.join_next()).await
    {
        match joined {
            Ok(Ok(manifest)) => return Ok(manifest),
            Ok(Err(e)) => failures.push(e),
            Err(e) => failures.push(Error::connection(format!("manifest ask failed: {e}"))),
        }
    }
    Err(combine(failures, "no source sent the manifest"))
}

/// Fetches every byte of `dest` from `sources`, where region i of the destination
/// receives region i of the sources' published state. Returns only once no task
/// writes into `dest` any more — on success, failure, timeout and `cancel` alike.
pub async fn fetch_state(
    sources: &[String],
    step: i64,
    quorum_id: u64,
    dest: Vec<DestRegion>,
    options: FetchOptions,
    cancel: impl Future<Output = ()>,
) -> Result<FetchStats, Error> {
    check_sources(sources)?;
    check_destination(&dest)?;
    if options.connections_per_source == 0 {
        return Err(Error::invalid("connections_per_source must be 1 or more"));
    }
    if options.chunk_bytes == 0 || options.chunk_bytes > MAX_CHUNK_LEN {
        return Err(Error::invalid(format!(
            "chunk_bytes must be between 1 and {MAX_CHUNK_LEN}, got {}",
            options.chunk_bytes
        )));
    }
    let started = Instant::now();
    let lens: Vec<u64> = dest.iter().map(|r| r.len as u64).collect();
    let heal = Arc::new(Heal {
        ask: Ask::new(step, quorum_id, &options.token, options.stall_timeout)?,
        sources: sources.to_vec(),
        deadline: started + options.timeout,
        progress: Mutex::new(Progress {
            plan: StripePlan::new(chunks(&lens, options.chunk_bytes), sources.len()),
            received: vec![0; sources.len()],
            refetches: 0,
            failures: sources.iter().map(|_| None).collect(),
            waiting: vec![None; sources.len()],
            fatal: None,
        }),
        changed: Notify::new(),
        max_attempts: options.max_attempts.max(1),
        lens,
        dest,
        options,
    });
    let mut links = JoinSet::new();
    for source in 0..sources.len() {
        for _ in 0..heal.options.connections_per_source {
            links.spawn(run_link(heal.clone(), source));
        }
    }
    let outcome = tokio::select! {
        biased;
        () = cancel => Err(Error::cancelled("the heal was cancelled")),
        finished = tokio::time::timeout_at(heal.deadline, heal.finished()) => {
            finished.unwrap_or_else(|_| Err(heal.timeout_error()))
        }
    };
    links.abort_all();
    while links.join_next().await.is_some() {}
    // Only from here on does nothing write into `dest`.
    outcome.map(|()| heal.stats(started))
}

fn check_sources(sources: &[String]) -> Result<(), Error> {
    if sources.is_empty() {
        return Err(Error::invalid(
            "no sources to heal from: pass the state addresses of the up-to-date peers",
        ));
    }
    Ok(())
}

/// Two regions that share bytes would have two connections write the same memory.
fn check_destination(dest: &[DestRegion]) -> Result<(), Error> {
    let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(dest.len());
    for (i, r) in dest.iter().enumerate().filter(|(_, r)| r.len > 0) {
        let end = r
            .addr
            .checked_add(r.len)
            .ok_or_else(|| Error::invalid(format!("destination region {i} wraps around memory")))?;
        spans.push((r.addr, end, i));
    }
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
        if start < end {
            return Err(Error::invalid(format!(
                "destination regions {a} and {b} overlap; give each tensor its own memory"
            )));
        }
    }
    Ok(())
}

/// One heal in progress, shared by its connection tasks.
struct Heal {
    ask: Ask,
    sources: Vec<String>,
    dest: Vec<DestRegion>,
    lens: Vec<u64>,
    options: FetchOptions,
    deadline: Instant,
    max_attempts: u32,
    progress: Mutex<Progress>,
    /// Woken on every change of `progress` that a waiting task may care about.
    changed: Notify,
}

struct Progress {
    plan: StripePlan,
    received: Vec<u64>,
    refetches: u64,
    failures: Vec<Option<Error>>,
    /// Why each source is being waited for, for the timeout message.
    waiting: Vec<Option<String>>,
    fatal: Option<Error>,
}

impl Heal {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update<T>(&self, f: impl FnOnce(&mut Progress) -> T) -> T {
        let out = f(&mut self.progress());
        self.changed.notify_waiters();
        out
    }

    /// The destination bytes of `chunk`.
    ///
    /// # Safety
    /// The caller holds `chunk` in the plan (taken, not yet completed or given back):
    /// the plan hands each chunk to one connection at a time, and chunks never share
    /// bytes, so no two live slices overlap.
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk_bytes(&self, chunk: Chunk) -> &mut [u8] {
        let region = self.dest[chunk.region as usize];
        debug_assert!(chunk.offset + chunk.len <= region.len as u64);
        std::slice::from_raw_parts_mut(
            (region.addr + chunk.offset as usize) as *mut u8,
            chunk.len as usize,
        )
    }

    /// The next chunk for a connection of `source`, waiting while every remaining
    /// chunk is in flight elsewhere (one may fail and come back). None: stop.
    async fn next_chunk(&self, source: usize) -> Option<(usize, Chunk)> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut p = self.progress();
                if p.plan.is_done() || p.fatal.is_some() || !p.plan.is_live(source) {
                    return None;
                }
                if let Some(next) = p.plan.take(source) {
                    p.waiting[source] = None;
                    return Some(next);
                }
            }
            changed.await;
        }
    }

    /// Like `next_chunk`, without waiting.
    fn try_next_chunk(&self, source: usize) -> Option<(usize, Chunk)> {
        let mut p = self.progress();
        if p.plan.is_done() || p.fatal.is_some() || !p.plan.is_live(source) {
            return None;
        }
        p.plan.take(source)
    }

    fn completed(&self, source: usize, index: usize) {
        self.update(|p| {
            p.plan.complete(index);
            p.received[source] += p.plan.chunk(index).len;
        });
    }

    fn damaged(&self, source: usize, index: usize) {
        let max_attempts = self.max_attempts;
        let address = &self.sources[source];
        self.update(|p| {
            p.refetches += 1;
            p.plan.give_back(index);
            if p.plan.attempts(index) >= max_attempts {
                let c = p.plan.chunk(index);
                p.fatal = Some(Error::connection(format!(
                    "bytes {}..+{} of region {} arrived damaged {max_attempts} times (last from \
                     {address}); the network or a source's memory corrupts data",
                    c.offset, c.len, c.region
                )));
            }
        });
    }

    /// Drops `source`; the chunks its connection held go back to the others.
    fn source_failed(&self, source: usize, held: impl IntoIterator<Item = usize>, error: Error) {
        self.update(|p| {
            for index in held {
                p.plan.give_back(index);
                p.refetches += 1;
            }
            p.plan.remove_source(source);
            p.failures[source].get_or_insert(error);
        });
    }

    fn waiting_for(&self, source: usize, why: String) {
        self.progress().waiting[source] = Some(why);
    }

    /// Resolves when every chunk arrived, or the heal cannot complete.
    async fn finished(&self) -> Result<(), Error> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let p = self.progress();
                if p.plan.is_done() {
                    return Ok(());
                }
                if let Some(fatal) = &p.fatal {
                    return Err(Error::transfer(fatal.kind(), fatal.message()));
                }
                if p.plan.is_stuck() {
                    let failures = self.sources.iter().zip(&p.failures).filter_map(|(a, f)| {
                        f.as_ref()
                            .map(|f| Error::transfer(f.kind(), format!("{a}: {}", f.message())))
                    });
                    return Err(combine(failures.collect(), "every source failed"));
                }
            }
            changed.await;
        }
    }

    fn timeout_error(&self) -> Error {
        let p = self.progress();
        let total: u64 = self.lens.iter().sum();
        let got: u64 = p.received.iter().sum();
        let mut message = format!(
            "healed {got} of {total} bytes within {:?} from {} of {} sources",
            self.options.timeout,
            p.plan.live_sources(),
            self.sources.len()
        );
        for (source, why) in p.waiting.iter().enumerate() {
            if let Some(why) = why {
                message.push_str(&format!("; {why}"));
            } else if let Some(f) = &p.failures[source] {
                message.push_str(&format!(
                    "; {} failed: {}",
                    self.sources[source],
                    f.message()
                ));
            }
        }
        message.push_str("; raise the timeout or check the sources");
        Error::timeout(message)
    }

    fn stats(&self, started: Instant) -> FetchStats {
        let p = self.progress();
        FetchStats {
            bytes: p.received.iter().sum(),
            seconds: started.elapsed().as_secs_f64(),
            chunks: p.plan.chunk_count(),
            refetches: p.refetches,
            per_source: self
                .sources
                .iter()
                .cloned()
                .zip(p.received.iter().copied())
                .collect(),
            failed_sources: self
                .sources
                .iter()
                .zip(&p.failures)
                .filter_map(|(a, f)| f.as_ref().map(|f| (a.clone(), f.message().clone())))
                .collect(),
        }
    }
}

/// One connection of a heal: opens, checks that the source serves the same layout as
/// the destination, then fetches chunks until none are left for it. It keeps
/// `PIPELINE` requests outstanding, so the source starts on the next chunk while the
/// last bytes of the previous one are still on their way (no idle round trip).
async fn run_link(heal: Arc<Heal>, source: usize) {
    let address = heal.sources[source].clone();
    let mut link = match open_link(&heal, source, &address).await {
        Ok(link) => link,
        Err(e) => return heal.source_failed(source, [], e),
    };
    // Chunks asked for on this connection, in the order the source answers them.
    let mut asked: VecDeque<(usize, Chunk)> = VecDeque::with_capacity(PIPELINE);
    loop {
        while asked.len() < PIPELINE {
            let next = if asked.is_empty() {
                heal.next_chunk(source).await
            } else {
                heal.try_next_chunk(source)
            };
            let Some((index, chunk)) = next else { break };
            asked.push_back((index, chunk));
            if let Err(e) = link.ask_chunk(chunk).await {
                return heal.source_failed(source, asked.iter().map(|(i, _)| *i), e);
            }
        }
        let Some(&(index, chunk)) = asked.front() else {
            return;
        };
        // SAFETY: this task holds `index` until it completes or gives it back below.
        let dest = unsafe { heal.chunk_bytes(chunk) };
        match link.receive_chunk(chunk, dest).await {
            Ok(intact) => {
                asked.pop_front();
                if intact {
                    heal.completed(source, index);
                } else {
                    heal.damaged(source, index);
                }
            }
            Err(e) => return heal.source_failed(source, asked.iter().map(|(i, _)| *i), e),
        }
    }
}

async fn open_link(heal: &Heal, source: usize, address: &str) -> Result<Link, Error> {
    let mut link = Link::connect(address, &heal.ask, heal.deadline).await?;
    let waiting = |why: String| heal.waiting_for(source, why);
    let payload = link
        .ask_until_served(RequestKind::Layout, heal.deadline, &waiting)
        .await?;
    let served = decode_layout(&payload).map_err(|e| link.lost("with a bad layout", e))?;
    check_layout(address, &served, &heal.lens)?;
    Ok(link)
}

/// The source must publish exactly the regions the destination has, byte for byte.
fn check_layout(address: &str, served: &[u64], dest: &[u64]) -> Result<(), Error> {
    if served.len() != dest.len() {
        return Err(Error::invalid(format!(
            "state server {address} publishes {} regions, the destination has {}; every rank \
             must register the same state",
            served.len(),
            dest.len()
        )));
    }
    if let Some(i) = (0..dest.len()).find(|&i| served[i] != dest[i]) {
        return Err(Error::invalid(format!(
            "region {i} has {} bytes at state server {address} but {} in the destination; \
             every rank must register the same state",
            served[i], dest[i]
        )));
    }
    Ok(())
}

/// One error out of several: refusals first (a token or quorum problem is what the
/// user must fix), then bad input, then the rest.
fn combine(errors: Vec<Error>, summary: &str) -> Error {
    let rank = |e: &Error| match e.kind() {
        ErrorKind::Permission => 0,
        ErrorKind::InvalidInput => 1,
        ErrorKind::Timeout => 2,
        _ => 3,
    };
    let kind = errors
        .iter()
        .min_by_key(|e| rank(e))
        .map_or(ErrorKind::Connection, |e| e.kind());
    let details: Vec<String> = errors.into_iter().map(|e| e.message()).collect();
    Error::transfer(kind, format!("{summary}: {}", details.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_destinations_are_refused() {
        let r = |addr, len| unsafe { DestRegion::new(addr, len) };
        assert!(check_destination(&[r(100, 10), r(110, 5), r(0, 0), r(105, 0)]).is_ok());
        let err = check_destination(&[r(100, 10), r(109, 5)]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(
            err.message().contains("regions 0 and 1 overlap"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn a_layout_mismatch_names_the_region() {
        let err = check_layout("a:1", &[4, 8, 16], &[4, 9, 16]).unwrap_err();
        assert!(
            err.message().contains("region 1 has 8 bytes"),
            "{}",
            err.message()
        );
        assert!(check_layout("a:1", &[4], &[4, 4]).is_err());
    }

    #[test]
    fn a_refusal_outranks_connection_failures() {
        let err = combine(
            vec![Error::connection("reset"), Error::refused("token")],
            "every source failed",
        );
        assert_eq!(err.kind(), ErrorKind::Permission);
        assert!(err
            .message()
            .starts_with("every source failed: reset; token"));
    }
}
