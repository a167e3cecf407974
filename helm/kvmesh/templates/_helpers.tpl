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
{{- else }}
{{- $url := required "redis.enabled is false: set externalRedis.url or externalRedis.existingSecret" .Values.externalRedis.url }}
{{- if .Values.externalRedis.caSecret }}
{{- $url = printf "%s%sssl_ca_certs=%s/ca.crt" $url (ternary "&" "?" (contains "?" $url)) (include "kvmesh.redisCADir" .) }}
{{- end }}
- name: KVMESH_REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- with .Values.kvmesh.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes and mounts of every Ray pod: /dev/shm in memory, the kvmesh ConfigMap, the Redis CA */}}
{{- define "kvmesh.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: kvmesh-config
  configMap:
    name: {{ include "kvmesh.fullname" .root }}-config
    defaultMode: 0755
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
