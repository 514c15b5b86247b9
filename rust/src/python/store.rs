//! A connection to a replica group's rendezvous store.

use std::time::Duration;

use pyo3::prelude::*;

use super::runtime::{connect, wait};
use super::seconds;

/// A connection to a replica group's rendezvous store, served by the group's manager
/// server behind the job token. `timeout` bounds every call; `get` and `wait` wait that
/// long (or their own `timeout`) for the keys, and for a store that is still starting.
#[pyclass(module = "phalanx._core", frozen)]
pub struct StoreClient {
    inner: crate::store::client::StoreClient,
    timeout: Duration,
}

#[pymethods]
impl StoreClient {
    #[new]
    #[pyo3(signature = (address, token = None, timeout = 30.0, connect_timeout = 5.0))]
    fn new(
        py: Python<'_>,
        address: &str,
        token: Option<String>,
        timeout: f64,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let timeout = seconds("timeout", timeout)?;
        let inner = connect(py, token, connect_timeout, |token, connect_timeout| {
            crate::store::client::StoreClient::new(address, token, connect_timeout)
        })?;
        Ok(StoreClient { inner, timeout })
    }

    #[getter]
    fn address(&self) -> String {
        self.inner.address().to_string()
    }

    /// The deadline of every call, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    fn set(&self, py: Python<'_>, key: String, value: &[u8]) -> PyResult<()> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        let value = bytes::Bytes::copy_from_slice(value);
        wait(py, async move { client.set(key, value, timeout).await })
    }

    #[pyo3(signature = (key, timeout = None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: String,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let timeout = self.wait_time(timeout)?;
        let client = self.inner.clone();
        let value = wait(py, async move { client.get(&key, timeout).await })?;
        Ok(pyo3::types::PyBytes::new(py, &value))
    }

    fn add(&self, py: Python<'_>, key: String, delta: i64) -> PyResult<i64> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.add(key, delta, timeout).await })
    }

    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: String,
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        let (expected, desired) = (expected.to_vec(), bytes::Bytes::copy_from_slice(desired));
        let current = wait(py, async move {
            client.compare_set(key, expected, desired, timeout).await
        })?;
        Ok(pyo3::types::PyBytes::new(py, &current))
    }

    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.check(keys, timeout).await })
    }

    /// Returns once every key is set, with their values when they are small (else
    /// an empty list).
    #[pyo3(signature = (keys, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyBytes>>> {
        let timeout = self.wait_time(timeout)?;
        let client = self.inner.clone();
        let values = wait(py, async move { client.wait(&keys, timeout).await })?;
        Ok(values
            .iter()
            .map(|v| pyo3::types::PyBytes::new(py, v))
            .collect())
    }

    fn delete_key(&self, py: Python<'_>, key: String) -> PyResult<bool> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.delete_key(key, timeout).await })
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        let (client, timeout) = (self.inner.clone(), self.timeout);
        wait(py, async move { client.num_keys(timeout).await })
    }
}

impl StoreClient {
    fn wait_time(&self, timeout: Option<f64>) -> PyResult<Duration> {
        timeout.map_or(Ok(self.timeout), |t| seconds("timeout", t))
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StoreClient>()?;
    Ok(())
}
