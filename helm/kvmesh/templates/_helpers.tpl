{{/* Names */}}
{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvmesh.redisSelector" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvmesh.keyPrefix" -}}
{{- default .Release.Name .Values.kvmesh.keyPrefix -}}
{{- end -}}

{{- define "kvmesh.redisSecretName" -}}
{{- default (printf "%s-redis" (include "kvmesh.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "kvmesh.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "kvmesh.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* Mount points on the Ray pods */}}
{{- define "kvmesh.redisCADir" -}}/etc/kvmesh-redis-tls{{- end -}}

{{/* Where the Ray pods find the CA of a TLS Redis: the chart's TLS Secret or externalRedis.caSecret */}}
{{- define "kvmesh.redisCASecret" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.tls.enabled -}}{{ .Values.redis.tls.existingSecret }}{{- end -}}
{{- else -}}
{{- .Values.externalRedis.caSecret -}}
{{- end -}}
{{- end -}}

{{/* The environment every Ray container gets: kvmesh's config file, key prefix and directory URL */}}
{{- define "kvmesh.env" -}}
- name: KVMESH_CONFIG
  value: /etc/kvmesh/kvmesh.yaml
- name: KVMESH_KEY_PREFIX
  value: {{ include "kvmesh.keyPrefix" . | quote }}
{{- if .Values.redis.enabled }}
{{- $scheme := ternary "rediss" "redis" .Values.redis.tls.enabled }}
{{- $query := ternary (printf "?ssl_ca_certs=%s/ca.crt" (include "kvmesh.redisCADir" .)) "" .Values.redis.tls.enabled }}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: KVMESH_REDIS_URL
  value: {{ printf "%s://:$(REDIS_PASSWORD)@%s:6379/0%s" $scheme (include "kvmesh.redisHost" .) $query | quote }}
{{- else }}
- name: KVMESH_REDIS_URL
  value: {{ printf "%s://%s:6379/0%s" $scheme (include "kvmesh.redisHost" .) $query | quote }}
{{- end }}
{{- else if .Values.externalRedis.existingSecret }}
- name: KVMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.externalRedis.existingSecret }}
      key: {{ .Values.externalRedis.existingSecretKey }}
{{- else if include "kvmesh.externalRedisURLHasPassword" . }}
{{- /* a password never goes into the RayCluster's (and so every pod's) spec: the URL is in a Secret of ours */}}
- name: KVMESH_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvmesh.externalRedisURLSecretName" . }}
      key: redis-url
{{- else }}
- name: KVMESH_REDIS_URL
  value: {{ include "kvmesh.externalRedisURL" . | quote }}
{{- end }}
{{- if include "kvmesh.redisCASecret" . }}
{{- /* the mounted CA for a rediss:// URL that names none (one kept whole in externalRedis.existingSecret) */}}
- name: KVMESH_REDIS_CA_CERTS
  value: {{ printf "%s/ca.crt" (include "kvmesh.redisCADir" .) | quote }}
{{- end }}
{{- range .Values.kvmesh.env }}
{{- /* EnvVar.value is a string: a number or boolean from --set or a values file would be refused by the API
     server (a whole float64 from a values file is written as an integer, not 1e+06) */}}
{{- $e := deepCopy . }}
{{- if hasKey $e "value" }}
{{- $v := $e.value }}
{{- if kindIs "invalid" $v }}{{ $v = "" }}{{ end }}
{{- if and (kindIs "float64" $v) (eq (float64 (int64 $v)) $v) }}{{ $v = int64 $v }}{{ end }}
{{- $_ := set $e "value" (toString $v) }}
{{- end }}
- {{ toYaml $e | nindent 2 | trim }}
{{- end }}
{{- end -}}

{{/* externalRedis.url, with the mounted CA added as ssl_ca_certs when externalRedis.caSecret is set */}}
{{- define "kvmesh.externalRedisURL" -}}
{{- $url := required "redis.enabled is false: set externalRedis.url or externalRedis.existingSecret" .Values.externalRedis.url }}
{{- if .Values.externalRedis.caSecret }}
{{- $url = printf "%s%sssl_ca_certs=%s/ca.crt" $url (ternary "&" "?" (contains "?" $url)) (include "kvmesh.redisCADir" .) }}
{{- end }}
{{- $url -}}
{{- end -}}

{{/* "true" when externalRedis.url holds a password: user:password@ or ?password= */}}
{{- define "kvmesh.externalRedisURLHasPassword" -}}
{{- $url := .Values.externalRedis.url | default "" }}
{{- if or (regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*:[^/?#]*@" $url) (regexMatch "[?&]password=" $url) -}}
true
{{- end -}}
{{- end -}}

{{- define "kvmesh.externalRedisURLSecretName" -}}
{{- printf "%s-redis-url" (include "kvmesh.fullname" .) -}}
{{- end -}}

{{/* Volumes and mounts of every Ray pod: /dev/shm in memory, the kvmesh ConfigMap, the disk tier's directory
     (kvmesh.config.disk_dir: kvmesh.diskVolume, else an emptyDir; the image's own file system is neither writable
     there by Ray's user nor meant for hundreds of GiB), the Redis CA */}}
{{- define "kvmesh.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: kvmesh-config
  configMap:
    name: {{ include "kvmesh.fullname" .root }}-config
    defaultMode: 0755
{{- with (default dict .root.Values.kvmesh.config).disk_dir }}
- name: kvmesh-disk
{{- with $.root.Values.kvmesh.diskVolume }}
  {{- toYaml . | nindent 2 }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- with include "kvmesh.redisCASecret" .root }}
- name: redis-ca
  secret:
    secretName: {{ . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{- define "kvmesh.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: kvmesh-config
  mountPath: /etc/kvmesh
  readOnly: true
{{- with (default dict .Values.kvmesh.config).disk_dir }}
{{- if not (isAbs (toString .)) }}
{{- fail (printf "kvmesh.config.disk_dir must be an absolute path, got %q" (toString .)) }}
{{- end }}
- name: kvmesh-disk
  mountPath: {{ . }}
{{- end }}
{{- if include "kvmesh.redisCASecret" . }}
- name: redis-ca
  mountPath: {{ include "kvmesh.redisCADir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Container resources, with gpus added as nvidia.com/gpu */}}
{{- define "kvmesh.resources" -}}
{{- $r := deepCopy (default dict .resources) -}}
{{- if and .gpus (gt (int .gpus) 0) -}}
{{- $limits := default dict $r.limits -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $r "limits" $limits -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}
