//! Checks on every field that crosses the wire. A bad request gets an error that
//! names the field and the fix; it never reaches the quorum engine.

use tonic::Status;

use crate::proto::{self, PROTOCOL_VERSION};

pub const MAX_REPLICA_ID_LEN: usize = 128;
pub const MAX_ADDRESS_LEN: usize = 256;
pub const MAX_WORLD_SIZE: u32 = 65_536;
/// Longest wait a caller may ask for: a day. Longer is a bug in the caller.
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;

pub fn protocol_version(version: u32) -> Result<(), Status> {
    if version == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(Status::failed_precondition(format!(
            "protocol version {version} is not supported: this server speaks version \
             {PROTOCOL_VERSION}; run the same phalanx version on every host of the job"
        )))
    }
}

pub fn replica_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument(
            "replica id is empty; give every replica group a name (--replica-id or PHALANX_REPLICA_ID)",
        ));
    }
    name("replica id", id, MAX_REPLICA_ID_LEN, "")
}

/// A name (of a replica group, of a job): at most `max_len` bytes of letters, digits,
/// '.', '_' and '-'; `how` says where it was given, for the error.
pub fn name(what: &str, name: &str, max_len: usize, how: &str) -> Result<(), Status> {
    if name.len() > max_len {
        return Err(Status::invalid_argument(format!(
            "{what} is {} bytes long; use at most {max_len}{how}",
            name.len()
        )));
    }
    if let Some((at, c)) = name
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Status::invalid_argument(format!(
            "{what} {name:?} has {c:?} at byte {at}; use only letters, digits, '.', '_' and \
             '-'{how}"
        )));
    }
    Ok(())
}

pub fn step(step: i64) -> Result<(), Status> {
    if step < 0 {
        return Err(Status::invalid_argument(format!(
            "step {step} is negative; steps count committed steps from 0"
        )));
    }
    Ok(())
}

/// Quorum ids above this are refused: at a thousand quorums a second a job would need
/// 285,000 years to reach it, so a larger one is a bug or an attack, and refusing it
/// keeps `id + 1` far from overflowing (invariant I3: ids never wrap or repeat).
pub const MAX_QUORUM_ID: u64 = 1 << 53;

/// The most groups a member may report it could not reach: the ranks probe at most
/// this many peers after a failed step.
pub const MAX_UNREACHABLE: usize = 64;

pub fn quorum_id(field: &str, id: u64) -> Result<(), Status> {
    if id > MAX_QUORUM_ID {
        return Err(Status::invalid_argument(format!(
            "{field} {id} is implausible (above {MAX_QUORUM_ID}); send the id of a quorum \
             this job issued, or 0"
        )));
    }
    Ok(())
}

/// A heartbeat beat's numbers.
pub fn beat(beat: &proto::Beat) -> Result<(), Status> {
    step(beat.step)?;
    if !beat.manager_address.is_empty() {
        address("manager address", &beat.manager_address)?;
    }
    quorum_id("last_quorum_id", beat.last_quorum_id)?;
    quorum_id("state_quorum_id", beat.state_quorum_id)?;
    quorum_id("lineage", beat.lineage)
}

/// A quorum request on `replica_id`'s heartbeat stream: its requester and wait.
pub fn ask(
    ask: &proto::QuorumAsk,
    replica_id: &str,
) -> Result<(proto::Member, std::time::Duration), Status> {
    let member = ask
        .requester
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("quorum ask without a requester"))?;
    if member.replica_id != replica_id {
        return Err(Status::permission_denied(format!(
            "a quorum ask for {:?} came on the heartbeat stream of {replica_id:?}; a group \
             asks for itself only",
            member.replica_id
        )));
    }
    self::member(member)?;
    Ok((member.clone(), timeout_ms(ask.timeout_ms)?))
}

pub fn world_size(world_size: u32) -> Result<(), Status> {
    if world_size == 0 || world_size > MAX_WORLD_SIZE {
        return Err(Status::invalid_argument(format!(
            "world size {world_size} is out of range; a replica group has 1 to {MAX_WORLD_SIZE} ranks"
        )));
    }
    Ok(())
}

pub fn address(field: &str, address: &str) -> Result<(), Status> {
    if address.len() > MAX_ADDRESS_LEN {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes long; an address has at most {MAX_ADDRESS_LEN}",
            address.len()
        )));
    }
    if address.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(Status::invalid_argument(format!(
            "{field} {address:?} contains whitespace or control characters"
        )));
    }
    Ok(())
}

pub fn timeout_ms(timeout_ms: u64) -> Result<std::time::Duration, Status> {
    if timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS {
        return Err(Status::invalid_argument(format!(
            "timeout of {timeout_ms} ms is out of range; give 1 ms to {MAX_TIMEOUT_MS} ms"
        )));
    }
    Ok(std::time::Duration::from_millis(timeout_ms))
}

pub fn member(m: &proto::Member) -> Result<(), Status> {
    replica_id(&m.replica_id)?;
    step(m.step)?;
    quorum_id("state_quorum_id", m.state_quorum_id)?;
    quorum_id("lineage", m.lineage)?;
    if m.unreachable.len() > MAX_UNREACHABLE {
        return Err(Status::invalid_argument(format!(
            "{} unreachable groups named; name at most {MAX_UNREACHABLE}, those of the last \
             quorum that could not be reached",
            m.unreachable.len()
        )));
    }
    for id in &m.unreachable {
        replica_id(id)?;
    }
    world_size(m.world_size)?;
    address("manager address", &m.manager_address)?;
    address("store address", &m.store_address)?;
    if m.state_addresses.len() > m.world_size as usize {
        return Err(Status::invalid_argument(format!(
            "{} state addresses for a group of {} ranks; send one per rank",
            m.state_addresses.len(),
            m.world_size
        )));
    }
    for a in &m.state_addresses {
        address("state address", a)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_are_checked_for_length_and_characters() {
        assert!(replica_id("group-0.a_b").is_ok());
        let err = replica_id("a b").unwrap_err();
        assert!(err.message().contains("' ' at byte 1"), "{}", err.message());
        assert!(replica_id("").is_err());
        assert!(replica_id(&"x".repeat(129)).is_err());
        assert!(replica_id("é").is_err());
    }

    #[test]
    fn numbers_out_of_range_are_refused() {
        assert!(step(-1).is_err());
        assert!(step(0).is_ok());
        assert!(world_size(0).is_err());
        assert!(timeout_ms(0).is_err());
        assert!(timeout_ms(MAX_TIMEOUT_MS + 1).is_err());
        assert!(protocol_version(PROTOCOL_VERSION + 1).is_err());
    }
}
